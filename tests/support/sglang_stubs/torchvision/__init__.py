"""An import-only stand-in for torchvision, for SGLang's tests only (not the package).

PyPI's Linux torchvision wheels are CUDA builds that fail to import beside the CPU
build of torch ("operator torchvision::nms does not exist"). SGLang's host-pool
modules import it at module level, through ``sglang.srt.configs`` (multimodal
preprocessing that nothing on the HiCache path calls), and transformers imports it
once it finds the package. Every ``torchvision.*`` module is made on demand; every
class in it raises when used; ``InterpolationMode`` is a real enum because
transformers builds tables from its members at import time. .ci/run puts this folder
on the path of the SGLang lane alone.
"""

import enum
import importlib
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+lmtier-test-stub"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class _Absent:
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("torchvision is a test stub here: the real package is not installed")

    def __class_getitem__(cls, item: object) -> type:
        return cls


class _Module(types.ModuleType):
    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        value: object
        if name == "InterpolationMode":
            value = InterpolationMode
        elif name[:1].islower():
            value = importlib.import_module(f"{self.__name__}.{name}")
        else:
            value = type(name, (_Absent,), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: object, target: object = None) -> object:
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


sys.meta_path.append(_Finder())
sys.modules[__name__].__class__ = _Module
