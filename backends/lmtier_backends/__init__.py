"""Storage backends that talk to the outside world (disk, Redis, S3).

Backends implement lmtier's byte-level tier interface, import only lmtier's public
modules, and never touch torch. They are found through entry points by name.
"""
