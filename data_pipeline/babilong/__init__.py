"""BABILong-style long-context tasks (Kuratov et al. 2024): the bAbI reasoning tasks (Weston
et al. 2015) with their facts scattered through long background text, generated offline and
seeded (babi.py, assemble.py), or read from the published files (official.py), and written
as episodic shards (writer.py) that the trainer and `memtrain eval --babilong` read."""
