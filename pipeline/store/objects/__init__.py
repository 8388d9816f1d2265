"""What one stored object holds, written and read back checked (on `pipeline.store.backends`).

    cache_ref.py     CacheRef: where an episode's cache object is, its bytes and checksum, the
                     models it belongs to (a manifest record's `ref`)
    cache_format.py  one episode's cache as safetensors (never pickle), checksummed
                     (its format version: pipeline.config.format_version)
    cache_read.py    the read path's one way in: an episode's cache (or bytes), verified, from
                     the disk tier or the store
    low_bit.py       keys and values in KIVI's low-bit codes (format 3: BuildConfig.code)
    zstd_object.py   a cache object compressed whole with zstd (BuildConfig.code.zstd)
    disk_tier.py     a bounded local-disk tier of cache objects (serving)
    turn_index.py    a conversation's turn index (every turn's text and embedding, for the
                     question-time top-up), checked as a cache object is
"""
