"""The ``fleet`` section: node ids that are safe in Redis keys, an index to write to,
and an index URL that never reaches a printed config."""

from __future__ import annotations

import pytest

from lmtier.config import LMTierConfig
from lmtier.errors import ConfigError


def test_fleet_needs_an_index_and_keeps_its_url_secret() -> None:
    with pytest.raises(ConfigError, match=r"fleet\.index_url or redis\.url"):
        LMTierConfig(fleet={"enabled": True})
    assert LMTierConfig(fleet={"enabled": True}, redis={"url": "redis://127.0.0.1:1/0"})
    url = "redis://:hunter2@127.0.0.1:1/0"
    shown = LMTierConfig(fleet={"enabled": True, "index_url": url}).to_dict()
    assert "hunter2" not in str(shown)


@pytest.mark.parametrize("bad", ["", "a b", "*", "-x", "x" * 64, "node:1", "n\u00e9"])
def test_a_node_id_is_safe_in_a_redis_key(bad: str) -> None:
    with pytest.raises(ConfigError):
        LMTierConfig(fleet={"node_id": bad})


def test_other_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="scheme"):
        LMTierConfig(fleet={"index_url": "http://127.0.0.1/"})
    with pytest.raises(ConfigError, match="half of ttl_s"):
        LMTierConfig(fleet={"interval_s": 6, "ttl_s": 10})
