"""The base of every config section: frozen, unknown keys refused, errors that name
the dotted key (:class:`~lmtier.errors.ConfigError`), and a checked :meth:`replace`."""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict
from pydantic import ValidationError as PydanticValidationError

from lmtier.config.types import config_error

__all__ = ["Section"]

_S = TypeVar("_S", bound="Section")


class Section(BaseModel):
    """What every section (and the whole config) shares: frozen, unknown keys refused,
    ConfigErrors, and :meth:`replace`."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        arbitrary_types_allowed=True,
        validate_default=True,
        use_attribute_docstrings=True,
    )
    SECTION: ClassVar[str] = ""

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except PydanticValidationError as exc:
            prefix = (self.SECTION,) if self.SECTION else ()
            raise config_error(exc, model=type(self), prefix=prefix) from None

    def replace(self: _S, **changes: Any) -> _S:
        """A copy with ``changes``, checked like any construction (``model_copy`` is not)."""
        return type(self)(
            **{**{name: getattr(self, name) for name in type(self).model_fields}, **changes}
        )
