"""Run configuration: one small dataclass per concern, composed into :class:`RunConfig`,
validated once, before any process starts.

Each concern (the job, A-SGD's parameter server, DASO, the data, faults, ...) is a
:class:`~cloudburst.config.fields.Section`: a dataclass whose fields carry their help in
``field(metadata=...)`` (written with :func:`option`) and whose ``defaults`` and ``validate``
sit next to them. A config reads by concern: ``cfg.training.lr``, ``cfg.asgd.n_sync``,
``cfg.daso.global_skip``. The strategies' settings live in their packages
(``strategies/<name>/settings.py``) and come here through the registry; what differs between
strategies is a trait or hook of their spec (``cfg.strategy_spec``), never a branch on the
name. ``cloudburst train``'s flags are generated from these fields (:mod:`cloudburst.cli`), so
a new setting is one field (and its check).

Outside the code, a field has one flat name (``daso_global_skip``, ``lr``): its flag
(``--daso-global-skip``), its top-level TOML key, its key in a run's config.json and in
:meth:`RunConfig.to_dict`, and the keyword of ``RunConfig(...)`` and :meth:`RunConfig.replace`.

A bad value raises :class:`ConfigError` whose message is one line naming the field, the value
and what is allowed; the CLI prints it and exits with code 2 without launching anything. Every
numeric field carries its range (:class:`~cloudburst.config.fields.Bounds`), checked first.
Config files are TOML (parsed with :mod:`tomllib`, which never executes code): flat keys
(``daso_global_skip = 4``), a ``[train]`` table of them, or one section per concern
(``[daso]`` with ``global_skip = 4``); command-line flags override file values. A TOML value
must have its field's type (``workers = "4"`` and ``steps = 1e20`` are refused: a string and
a float are not an int); flags, ``compare``'s specs and sweeps give text, parsed here.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import math
import tomllib
from pathlib import Path
from typing import Any

from cloudburst.config.cluster import ClusterConfig, JobConfig
from cloudburst.config.components import (  # noqa: F401
    DataConfig,
    FaultConfig,
    MetricsConfig,
    ModelConfig,
    OutputConfig,
    TrainingConfig,
)
from cloudburst.config.fields import (  # noqa: F401
    AUTOCASTS,
    BACKENDS,
    DATASETS,
    DEFAULT_SIZES,
    DEVICES,
    LR_SCHEDULES,
    MODELS,
    OPTIMIZERS,
    ConfigError,
    Section,
    Straggler,
    check_bounds,
    check_choice,
    check_float,
    check_int,
    field_message,
    option,
)
from cloudburst.strategies import settings_classes, strategy_spec
from cloudburst.strategies.spec import StrategySpec

#: The strategies' settings (one section each, from the registry), between the job's and the
#: cluster's in --help.
STRATEGY_SETTINGS: tuple[type, ...] = settings_classes()
COMPONENTS: tuple[type, ...] = (
    JobConfig,
    *STRATEGY_SETTINGS,
    ClusterConfig,
    DataConfig,
    ModelConfig,
    TrainingConfig,
    MetricsConfig,
    FaultConfig,
    OutputConfig,
)


def _fields() -> dict[str, tuple[type, dataclasses.Field]]:
    """Every field of every concern by its flat name: ``{"daso_global_skip": (DasoConfig,
    <field global_skip>)}``."""
    return {part.flat(f.name): (part, f) for part in COMPONENTS for f in dataclasses.fields(part)}


#: Every field by its flat name (the flag's, the TOML key's, config.json's), with its concern.
FIELDS: dict[str, tuple[type, dataclasses.Field]] = _fields()


class RunConfig:
    """Everything one training run needs: one section per concern (``cfg.training.lr``,
    ``cfg.asgd.n_sync``, ``cfg.cluster.inter_node_link``, ``cfg.daso.global_skip``).

    Made from flat names, as flags, TOML files and config.json give them
    (``RunConfig(strategy="asgd", workers=4, lr=0.05)``); :meth:`replace` makes a changed
    copy the same way and :meth:`to_dict` gives them back. Each concern fills its open values
    and is checked when the config is made (:meth:`validate`).
    """

    def __init__(self, **values: Any) -> None:
        given: dict[type, dict[str, Any]] = {part: {} for part in COMPONENTS}
        for name, value in values.items():
            if name not in FIELDS:
                raise TypeError(f"RunConfig: unknown field {name!r}")
            part, f = FIELDS[name]
            given[part][f.name] = value
        for part in COMPONENTS:
            setattr(self, part.section, part(**given[part]))
        if isinstance(self.faults.inject_fault, str):
            self.faults.inject_fault = [self.faults.inject_fault]
        self.check_bounds()  # the defaults below compute with these values
        # Defaults that depend on another concern's value.
        if self.job.servers is None:
            self.job.servers = 1 if self.strategy_spec.needs_servers else 0
        self.training.defaults(self)  # the GPT's recipe, or SGD's (config/components.py)
        for section in self.strategy_sections():  # asgd's n_sync and λ, DiLoCo's outer lr, ...
            section.defaults(self)
        self.validate()

    def sections(self) -> list[Section]:
        """Every concern's section, in --help's order."""
        return [getattr(self, part.section) for part in COMPONENTS]

    def strategy_sections(self) -> list[Section]:
        """The strategies' settings, in the registry's order."""
        return [getattr(self, part.section) for part in STRATEGY_SETTINGS]

    @property
    def strategy_spec(self) -> type[StrategySpec]:
        """The strategy's traits and rules (:mod:`cloudburst.strategies`)."""
        return strategy_spec(self.job.strategy)

    # ------------------------------------------------------------------ validation
    def check_bounds(self) -> None:
        """Every numeric field within its range."""
        for section in self.sections():
            check_bounds(section)

    def validate(self) -> None:
        """Each concern's checks, in this order (a later one may rely on an earlier one's
        defaults: the batch size on the data's size); the strategies' settings in the
        registry's order. Every numeric field's range is checked first."""
        self.check_bounds()
        for section in (self.job, self.data, self.model, self.cluster):
            section.validate(self)
        for section in self.strategy_sections():
            section.validate(self)
        self.strategy_spec.validate(self)
        for section in (self.training, self.metrics, self.faults):
            section.validate(self)

    def warnings(self) -> list[str]:
        """Valid settings that are known to train badly (printed by the CLI, one line each)."""
        return self.strategy_spec.warnings(self)

    @property
    def shard_rule(self) -> tuple[str, float]:
        """(rule, lr) of the parameter-server shards: the strategy's (EASGD's elastic centre,
        async DiLoCo's Delayed Nesterov), or the configured asgd rule."""
        return self.strategy_spec.shard_rule(self)

    # ------------------------------------------------------------------ derived values
    @property
    def world_size(self) -> int:
        return self.job.workers + self.job.servers

    @property
    def replicas(self) -> int:
        """How many replicas the strategy runs between: the workers, or the nodes (--replica
        node)."""
        if self.cluster.replica == "node" and self.cluster.nodes:
            return min(self.worker_nodes, self.job.workers)
        return self.job.workers

    @property
    def worker_nodes(self) -> int:
        """The nodes that run workers: every node, less the shards' own under ``own``."""
        nodes = self.cluster.nodes or 1
        own = self.cluster.shard_placement == "own" and self.job.servers and nodes > 1
        return nodes - 1 if own else nodes

    @property
    def ranks_per_replica(self) -> int:
        """Worker ranks in one replica (G): 1, or a node's workers."""
        workers = self.job.workers
        return workers // self.replicas if workers >= self.replicas else 1

    def straggler_factor(self, worker: int) -> float:
        factors = [s.factor for s in self.cluster.stragglers if s.worker == worker]
        return factors[-1] if factors else 1.0

    def dataset_kind_path(self) -> tuple[str, str | None]:
        """("mnist1d", None) or ("cifar10", "/path"): the dataset spec, checked."""
        from cloudburst.data.datasets import DatasetError, parse_dataset_spec

        try:
            return parse_dataset_spec(self.data.dataset)
        except DatasetError as e:
            raise ConfigError(field_message("dataset", e)) from None

    def steps_per_worker(self, train_size: int | None = None) -> int:
        """Local steps each worker takes: ``steps``, or ``epochs`` passes over its shard.

        ``train_size`` is the loaded dataset's size when the config leaves it open (a
        dataset read from a path); without either, an epoch count cannot be turned into steps.
        """
        if self.training.steps is not None:
            return self.training.steps
        size = self.data.train_size if train_size is None else train_size
        if size is None:
            raise ValueError("steps_per_worker: the dataset's size is not known yet")
        per_epoch = (size // self.job.workers) // self.training.batch_size
        return max(1, math.ceil(float(self.training.epochs) * per_epoch))

    # ------------------------------------------------------------------ flat names
    def get(self, name: str) -> Any:
        """The value of the field with flat name ``name`` (``cfg.get("daso_global_skip")``)."""
        if name not in FIELDS:
            raise AttributeError(f"RunConfig has no field {name!r}")
        part, f = FIELDS[name]
        return getattr(getattr(self, part.section), f.name)

    def values(self) -> dict[str, Any]:
        """Every field's value by flat name (the objects themselves: stragglers as
        :class:`Straggler`)."""
        return {name: self.get(name) for name in FIELDS}

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with some fields (by flat name) changed, made and checked anew (as
        :func:`dataclasses.replace` would: the values this config filled in stay)."""
        values = {k: copy.copy(v) for k, v in self.values().items()}
        return RunConfig(**{**values, **changes})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunConfig) and self.values() == other.values()

    def __repr__(self) -> str:
        return f"RunConfig({', '.join(f'{k}={v!r}' for k, v in self.values().items())})"

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        """Every field by flat name, as config.json holds it (stragglers as ``W:F``)."""
        d = {k: copy.deepcopy(v) for k, v in self.values().items()}
        d["stragglers"] = [f"{s.worker}:{s.factor}" for s in self.cluster.stragglers]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RunConfig:
        known = set(FIELDS)
        aliases = field_aliases()
        # Flags and TOML may spell names with dashes; an alias (``straggler``) wins over the
        # field's own name, as it did when it was the only one.
        values = {k.replace("-", "_"): v for k, v in values.items()}
        for alias, name in aliases.items():
            if alias in values:
                values[name] = values.pop(alias)
        unknown = sorted(set(values) - known)
        if unknown:
            near = difflib.get_close_matches(unknown[0], sorted(known | set(aliases)), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else " (see cloudburst train --help)"
            raise ConfigError(f"config: unknown field {unknown[0]!r}{hint}")
        raw_stragglers = values.get("stragglers") or []
        if isinstance(raw_stragglers, str):
            raw_stragglers = [raw_stragglers]
        values["stragglers"] = [
            s if isinstance(s, Straggler) else Straggler.parse(str(s)) for s in raw_stragglers
        ]
        for name, (_, f) in FIELDS.items():
            if name in values and name != "stragglers":
                values[name] = coerce_value(name, f.type, values[name])
        return cls(**values)

    @classmethod
    def from_toml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
        return cls.from_dict({**load_toml(path), **(overrides or {})})


def _field_names(part: type) -> set[str]:
    """The flat names of ``part``'s fields."""
    return {part.flat(f.name) for f in dataclasses.fields(part)}


@functools.cache
def field_aliases() -> dict[str, str]:
    """Other keys accepted for a field in files and dicts: ``{"straggler": "stragglers"}``."""
    return {
        alias: name for name, (_, f) in FIELDS.items() for alias in f.metadata.get("aliases", ())
    }


# ---------------------------------------------------------------------------- config files
def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config file into flat field names (``daso_global_skip``).

    Accepted: top-level keys, a ``[train]`` table of them (its values win over top-level
    ones), and one section per concern whose keys may drop the concern's prefix (``[daso]``
    ``global_skip``). A key set twice, or unknown in a section, is a one-line error.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config: file {str(p)!r} does not exist")
    try:
        data = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config: {str(p)!r} is not valid TOML ({e})") from None
    flat = _flatten_sections({k: v for k, v in data.items() if k != "train"})
    if isinstance(data.get("train"), dict):
        flat.update(_flatten_sections(data["train"]))
    elif "train" in data:
        flat["train"] = data["train"]  # from_dict names it as an unknown field
    for name, value in flat.items():
        if name in FIELDS:
            _check_toml_type(name, FIELDS[name][1].type, value, p.name)
    return flat


_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}


def _check_toml_type(name: str, type_text: Any, value: Any, source: str) -> None:
    """A TOML value of its field's type: an int field takes an integer (not ``"4"``, not
    ``1e20``, not ``true``), a float field a number, a bool field ``true``/``false``, a text
    field a string, a list field a string or an array of them."""
    kind = str(type_text).removesuffix(" | None")
    if kind == "int":
        ok, expected = type(value) is int, "an integer"
    elif kind == "float":
        ok, expected = type(value) in (int, float), "a number"
    elif kind == "bool":
        ok, expected = type(value) is bool, "true or false"
    elif kind == "str":
        ok, expected = type(value) is str, "a string"
    elif kind.startswith("list["):
        items = value if isinstance(value, list) else [value]
        ok, expected = all(type(v) is str for v in items), "a string or an array of strings"
    else:
        return
    if not ok:
        got = _TYPE_NAMES.get(type(value), f"a {type(value).__name__}")
        raise ConfigError(
            f"{name}: {value!r} in {source} is {got}; expected {expected} "
            f"(e.g. {name} = {_toml_example(kind)})"
        )


def _toml_example(kind: str) -> str:
    return {"int": "4", "float": "0.5", "bool": "true", "str": '"text"'}.get(kind, '["text"]')


def _flatten_sections(table: dict[str, Any]) -> dict[str, Any]:
    sections = {part.section: part for part in COMPONENTS}
    aliases = field_aliases()
    flat: dict[str, Any] = {}
    where: dict[str, str] = {}

    def put(name: str, value: Any, place: str) -> None:
        name = aliases.get(name, name)
        if name in flat:
            raise ConfigError(f"config: {name} is set twice ({where[name]} and {place}); keep one")
        flat[name], where[name] = value, place

    for key, value in table.items():
        key = key.replace("-", "_")
        if not isinstance(value, dict):
            put(key, value, "the top level")
        elif key in sections:
            for sub, sub_value in value.items():
                put(_section_field(sections[key], sub.replace("-", "_")), sub_value, f"[{key}]")
        else:
            near = difflib.get_close_matches(key, sorted(sections), n=1)
            hint = f"; did you mean [{near[0]}]?" if near else f" ({', '.join(sections)})"
            raise ConfigError(f"config: unknown section [{key}]{hint}")
    return flat


def _section_field(part: type, key: str) -> str:
    """The field a key of ``part``'s section names: ``global_skip`` in [daso] is
    ``daso_global_skip``; a field's full name is accepted too."""
    own = _field_names(part)
    own_aliases = {
        a: part.flat(f.name) for f in dataclasses.fields(part) for a in f.metadata["aliases"]
    }
    for name in (f"{part.section}_{key}", key):
        if name in own:
            return name
        if name in own_aliases:
            return own_aliases[name]
    name = field_aliases().get(key, key)
    homes = [other.section for other in COMPONENTS if name in _field_names(other)]
    if homes:
        raise ConfigError(
            f"config: {key!r} is not a [{part.section}] setting; it belongs in [{homes[0]}] "
            "(or at the top level)"
        )
    short = sorted(n.removeprefix(f"{part.section}_") for n in own | set(own_aliases))
    near = difflib.get_close_matches(key, short, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else f" (allowed: {', '.join(short)})"
    raise ConfigError(f"config: unknown field {key!r} in [{part.section}]{hint}")


# ---------------------------------------------------------------------------- values
def coerce_value(name: str, type_text: Any, value: Any) -> Any:
    """Convert TOML/CLI values to the annotated type, with a one-line error on mismatch."""
    text = str(type_text)
    if value is None:
        if "None" in text:
            return None
        raise ConfigError(f"{name}: a value is required")
    try:
        if text.startswith("int"):
            if not isinstance(value, int | str) or isinstance(value, bool):
                raise ValueError  # a float is not an int (1e20 is not a step count)
            return int(value)
        if text.startswith("float"):
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if text == "bool":
            if isinstance(value, str):
                if value.lower() in ("true", "1", "yes"):
                    return True
                if value.lower() in ("false", "0", "no"):
                    return False
                raise ValueError
            if not isinstance(value, bool):
                raise ValueError
            return value
        if text.startswith("str"):
            if not isinstance(value, str):
                raise ValueError
            return value
        if text == "list[str]":
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
                raise ValueError
            return list(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"{name}: {value!r} is not a valid {text.replace(' | None', '')}"
        ) from None
    return value


def refuse_code_from_file(
    values: dict[str, Any], flags: dict[str, Any], source: str, trust: bool
) -> None:
    """Code runs only when the user names it on the command line: a model factory
    (``package.module:function``) read from a file is refused unless ``--trust-config`` is
    given or ``--model`` repeats the same value. Checked before anything is imported."""
    from cloudburst.models import is_factory_spec

    model = values.get("model")
    if not isinstance(model, str) or not is_factory_spec(model) or trust:
        return
    if flags.get("model") == model:
        return
    raise ConfigError(
        f"model: {source} names the factory {model!r}, which would import and run that code; "
        f"pass --model {model} (or --trust-config) if you mean to run it"
    )
