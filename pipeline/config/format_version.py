"""The version of the cache object format, apart from the code that reads and writes it.

The build configuration hashes it (a new format rebuilds every cache), so it lives beside that
hash, computed without torch and below the store in the layers;
`pipeline.store.objects.cache_format` writes it and reads the versions listed here.
"""

FORMAT = "epicache-kv/2"
READABLE_FORMATS = ("epicache-kv/1", FORMAT)
