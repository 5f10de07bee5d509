"""Connector registry: names to classes (imported lazily), typed per-connector configs."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import TYPE_CHECKING, Any, TypeVar

from kvport.config import KVTransferConfig
from kvport.connectors.base import KVConnectorBase, KVConnectorRole
from kvport.connectors.hma import supports_hma

if TYPE_CHECKING:
    from kvport.trace.events import TraceHeader

# name -> (module, class name); imported only when a config names it
_REGISTRY: dict[str, tuple[str, str]] = {}

# extra-config keys every connector accepts; the framework consumes them
FRAMEWORK_KEYS = ("record_trace", "sees_all_stores")

T = TypeVar("T")


def register_connector(name: str, module: str, class_name: str) -> None:
    if name in _REGISTRY and _REGISTRY[name] != (module, class_name):
        raise ValueError(f"connector {name!r} is already registered as {_REGISTRY[name]}")
    _REGISTRY[name] = (module, class_name)


def registered_connectors() -> list[str]:
    return sorted(_REGISTRY)


def get_connector_class(config: KVTransferConfig) -> type[KVConnectorBase]:
    name = config.kv_connector
    if config.kv_connector_module_path:
        module_name, class_name = config.kv_connector_module_path, name
    elif name in _REGISTRY:
        module_name, class_name = _REGISTRY[name]
    else:
        raise ValueError(f"unknown KV connector {name!r}; registered: {registered_connectors()} "
                         f"(or give kv_connector_module_path)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import KV connector module {module_name!r}: {exc}") from exc
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase)):
        raise ValueError(f"{module_name}.{class_name} is not a KVConnectorBase subclass")
    return cls


def connector_class_for(config: KVTransferConfig) -> type[KVConnectorBase]:
    """The class `create_connector` builds for `config`: the registered (or module path) class,
    or the variant its `class_for_config` picks for this config (HMAMultiConnector for a
    MultiConnector whose children all handle KV cache groups)."""
    return get_connector_class(config).class_for_config(config)


def config_supports_hma(config: KVTransferConfig) -> bool:
    """Whether the connector `config` builds is SupportsHMA, known before it is built: the engine
    keeps a hybrid model's KV cache groups only then (kvport.engine.executor.engine_kv_groups).
    The instance agrees: both come from `connector_class_for`."""
    return supports_hma(connector_class_for(config))


def create_connector(config: KVTransferConfig, role: KVConnectorRole,
                     header: TraceHeader | None = None) -> KVConnectorBase:
    """Build the connector half for `role`; wrapped in a trace recorder if the config asks.

    `header`: the building engine's TraceHeader, which that recorder writes first. A connector
    class whose constructor takes a `header` keyword builds connectors of its own
    (MultiConnector): it gets the header to pass on to their create_connector."""
    cls = connector_class_for(config)
    if "header" in inspect.signature(cls).parameters:
        connector = cls(config, role, header=header)  # type: ignore[call-arg]
    else:
        connector = cls(config, role)
    trace_path = config.kv_connector_extra_config.get("record_trace")
    if trace_path:
        from kvport.connectors.recording import recorder_for

        connector = recorder_for(connector, str(trace_path), header)
    return connector


def parse_extra_config(cls: type[T], config: KVTransferConfig) -> T:
    """`kv_connector_extra_config` as the connector's frozen dataclass. Unknown keys and values
    of the wrong type raise ValueError naming the key and what is accepted."""
    assert dataclasses.is_dataclass(cls), f"{cls} is not a dataclass"
    extra = {k: v for k, v in config.kv_connector_extra_config.items() if k not in FRAMEWORK_KEYS}
    accepted = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(extra) - set(accepted))
    if unknown:
        raise ValueError(f"{config.kv_connector}: unknown kv_connector_extra_config key(s) {unknown}; "
                         f"accepted: {sorted(accepted) + list(FRAMEWORK_KEYS)}")
    for key, value in extra.items():
        _check_type(config.kv_connector, key, value, accepted[key].type)
    try:
        return cls(**extra)
    except TypeError as exc:
        raise ValueError(f"{config.kv_connector}: bad kv_connector_extra_config: {exc}") from None


_SIMPLE_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,), "float": (int, float), "str": (str,), "bool": (bool,),
    "list": (list, tuple), "dict": (dict,),
}


def _check_type(connector: str, key: str, value: Any, annotation: Any) -> None:
    # Annotations are strings under `from __future__ import annotations`: check the simple cases
    # ("int", "str | None", "list[dict[str, Any]]"); connectors validate ranges themselves.
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    options = [t.strip() for t in text.split("|")]
    if value is None and "None" in options:
        return
    allowed: tuple[type, ...] = ()
    for opt in options:
        allowed += _SIMPLE_TYPES.get(opt.split("[")[0], ())
    if not allowed:
        return
    if isinstance(value, bool) and bool not in allowed:
        allowed = ()
    if not isinstance(value, allowed):
        raise ValueError(f"{connector}: kv_connector_extra_config[{key!r}] must be {text}, "
                         f"got {value!r}")


register_connector("ExampleConnector", "kvport.connectors.example", "ExampleConnector")
register_connector("MultiConnector", "kvport.connectors.multi", "MultiConnector")
register_connector("NoOpConnector", "kvport.connectors.noop", "NoOpConnector")
register_connector("OffloadingConnector", "kvport.connectors.offloading.connector",
                   "OffloadingConnector")
