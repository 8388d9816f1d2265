"""The version of the cache object format, apart from the code that reads and writes it.

The build configuration hashes it (a new format rebuilds every cache), so it lives beside that
hash, computed without torch and below the store in the layers;
`pipeline.store.objects.cache_format` writes it and reads the versions listed here.
"""

FORMAT = "epicache-kv/2"
# format 2 with the keys and values in low-bit codes (`BuildConfig.code`): written only by builds
# that code them, whose hash already differs, so FORMAT (hashed by every build) stays 2
CODED_FORMAT = "epicache-kv/3"
# format 3 with some entries of each head kept as floats beside the codes (`CodeConfig`'s
# float_sinks and float_recent): written only by builds that keep them, whose hash differs
FLOATS_CODED_FORMAT = "epicache-kv/4"
# format 3 or 4 with the values coded at another width than the keys (`CodeConfig.value_bits`):
# a reader of format 4 would decode them at the keys' width, so it must refuse them
MIXED_BITS_FORMAT = "epicache-kv/5"
# format 3, 4 or 5 with the keys coded after a Hadamard turn (`CodeConfig.rotate`): a reader of
# format 5 would return them turned, so it must refuse them
ROTATED_FORMAT = "epicache-kv/6"
# format 3 to 6 with codes of 3, 5 or 6 bits (packed in two parts, their low bits first) or with
# the keys coded per token (`CodeConfig.key_axis`): a reader of format 6 would fail on the one and
# misread the other. Read, no longer written: SPLIT_FORMAT packs the high bits first.
LOW_FIRST_SPLIT_FORMAT = "epicache-kv/7"
# format 7 with a split code's high bits packed first (they compress; the lowest bit does not),
# or with the groups' steps and minimums double quantized (`CodeConfig.double_quant`): a reader
# of format 7 would misread the codes and fail on the scales, so it must refuse them
SPLIT_FORMAT = "epicache-kv/8"
# format 8 with the values coded after the Hadamard turn too (`CodeConfig.rotate_values`): a
# reader of format 8 would return them turned, so it must refuse them
TURNED_VALUES_FORMAT = "epicache-kv/9"
READABLE_FORMATS = ("epicache-kv/1", FORMAT, CODED_FORMAT, FLOATS_CODED_FORMAT, MIXED_BITS_FORMAT,
                    ROTATED_FORMAT, LOW_FIRST_SPLIT_FORMAT, SPLIT_FORMAT, TURNED_VALUES_FORMAT)
