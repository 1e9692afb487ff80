"""The programs the ``lmtier`` command runs above the connectors: ``lmtier demo``
(:mod:`.demo`), the demo engine ``lmtier demo serve`` (:mod:`.engine`), ``lmtier warm``
(:mod:`.warm`) and ``lmtier cluster`` (:mod:`.cluster`). Registered through the
``lmtier.commands`` entry point; nothing in ``lmtier`` or ``lmtier_connector`` imports them."""
