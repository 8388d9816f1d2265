"""The store: where caches, manifests and profiles live, and the index over them, in three parts
that differ in what they know (each imports only from the ones above it):

    backends/    where objects live: the Store interface and its backends by URI scheme (a
                 directory, S3, memory); bytes under keys, nothing about what they hold
    objects/     what one object holds: an episode's cache (its format and its verified read),
                 a conversation's turn index, the serving disk tier
    catalogue/   what a store holds: the per-conversation manifests (the commit point), the
                 manifest table over them, and what no manifest names (garbage)

The layout of a store is documented in docs/store.md.
"""
