"""data_pipeline/: corpora and tasks -> webdataset shards -> ordered per-rank segment streams.

Knows nothing of the model, DeepSpeed, MLflow or SLURM.

    corpora.py        the language-modelling benchmarks and your own text, with their splits
    find_files.py     a corpus's files on disk: present, extracted or downloaded (download.py)
    vocab.py          the Vocab interface and the byte, symbol and word vocabularies
    bpe.py            byte-level BPE; hf_tokenizer.py: a pretrained checkpoint's tokenizer
    vocab_by_kind.py  any vocabulary rebuilt from its description (what a manifest stores)
    tasks.py          the RMT and ARMT algorithmic tasks; babilong/: bAbI in long text
    synthetic.py      the repeat corpus of the quickstart
    prepare.py        `memtrain prepare`: corpus or task -> shards (shard_writer.py)
    shards.py         the manifest and shard reading; streams.py: ordered per-rank segments
    atomic.py         crash-safe file writes
"""
