"""Cross-field rules of the CephaloJob spec as CEL (`x-kubernetes-validations`), so that the
API server refuses at `kubectl apply` what pydantic refuses (`ModelConfig._check`, preset or
pretrained, `TokenFileData`, one checkpoint target, the job name; the planner's rule is in
planner_spec, text data's in data, the pod template's in podtemplate_rules).

The model rules must hold for a preset whose fields are overridden too (`preset: llama-tiny`
with `numHeads: 5`), so every rule reads a field's *effective* value: the field if given,
else the preset's, else the default that `ModelSpec.resolve` applies to a custom model. The
preset table is written into the rules as CEL map literals, generated from `PRESETS`, so
the CRD and the models cannot drift apart (the CRD drift test regenerates both).
"""

from __future__ import annotations

from typing import Any

from pydantic.alias_generators import to_camel
from pydantic.config import JsonValue

from cephalo.api.models import PRESETS, TEXT_FAMILIES


def _literal(value: Any) -> str:
    if isinstance(value, str):
        return "'" + value + "'"
    return str(int(value))


def _presets_with(field: str) -> list[str]:
    return sorted(name for name, values in PRESETS.items() if values.get(field) is not None)


def _has(field: str) -> str:
    """The field is given, or the preset supplies it."""
    camel = to_camel(field)
    names = ", ".join(_literal(n) for n in _presets_with(field))
    return f"(has(self.{camel}) || (has(self.preset) && self.preset in [{names}]))"


def _value(field: str) -> str:
    """The field's effective value; only meaningful where `_has(field)` holds."""
    camel = to_camel(field)
    table = ", ".join(f"{_literal(n)}: {_literal(PRESETS[n][field])}"
                      for n in _presets_with(field))
    return f"(has(self.{camel}) ? self.{camel} : {{{table}}}[self.preset])"


_FAMILY = _value("family")
_HAS_FAMILY = "(has(self.family) || has(self.preset))"


def _family_in(families: tuple[str, ...]) -> str:
    listed = ", ".join(_literal(f) for f in families)
    return f"({_HAS_FAMILY} && {_FAMILY} in [{listed}])"


def _custom_default(field: str) -> str:
    """Given, from the preset, or defaulted for a custom model by `ModelSpec.resolve`."""
    return f"({_has(field)} || !has(self.preset))"


# The "one of" rules of ModelSpec and CheckpointSpec: pydantic raises these very words (the
# checkpoint one followed by what was given), the API server says them at `kubectl apply`.
PRESET_OR_PRETRAINED = ("model: give either `preset` or `pretrained` (whose config.json is the "
                        "architecture), not both")
ONE_CHECKPOINT_TARGET = "checkpoint: give only one of claimName, uri and ephemeral: true"


def model_rules() -> list[JsonValue]:
    """`ModelSpec._preset_or_family`'s "not both" and `ModelConfig._check` on the effective
    values, one rule per check (same messages)."""
    hidden, heads = _value("hidden_size"), _value("num_heads")
    both = f"{_has('hidden_size')} && {_has('num_heads')}"
    return [
        {"rule": "!(has(self.preset) && has(self.pretrained))", "message": PRESET_OR_PRETRAINED},
        {"rule": f"!({both}) || {hidden} % {heads} == 0",
         "message": "hiddenSize must be divisible by numHeads"},
        {"rule": f"!({_family_in(('llama',))} && {_has('num_kv_heads')} && "
                 f"{_has('num_heads')}) || {heads} % {_value('num_kv_heads')} == 0",
         "message": "numHeads must be divisible by numKvHeads"},
        {"rule": f"!{_family_in(TEXT_FAMILIES)} || ({_has('vocab_size')} && "
                 f"{_custom_default('sequence_length')})",
         "message": "a gpt, llama or bert model needs vocabSize and sequenceLength"},
        {"rule": f"!{_family_in(('vit',))} || ({_has('image_size')} && {_has('patch_size')} "
                 f"&& {_has('num_classes')})",
         "message": "a vit model needs imageSize, patchSize and numClasses"},
        {"rule": f"!({_family_in(('vit',))} && {_has('image_size')} && {_has('patch_size')}) "
                 f"|| {_value('image_size')} % {_value('patch_size')} == 0",
         "message": "imageSize must be divisible by patchSize"},
        {"rule": f"!{_family_in(('bert',))} || {_custom_default('num_classes')}",
         "message": "a bert model needs numClasses (it is a sequence classifier)"},
        {"rule": f"!({_family_in(('llama',))} && {both} && {hidden} % {heads} == 0) || "
                 f"({hidden} / {heads}) % 2 == 0",
         "message": "llama head size (hiddenSize / numHeads) must be even for RoPE"},
    ]


def checkpoint_rules() -> list[JsonValue]:
    """`CheckpointSpec._one_target`: at most one of claimName, uri and ephemeral: true (the
    API server fills in ephemeral's default false, so it counts only when true)."""
    given = " + ".join(f"({test} ? 1 : 0)" for test in (
        "has(self.claimName)", "has(self.uri)", "(has(self.ephemeral) && self.ephemeral)"))
    return [{"rule": f"{given} <= 1", "message": ONE_CHECKPOINT_TARGET}]


# A path segment ".." (start, middle or end); RE2 syntax, which CEL's matches() uses.
PARENT_SEGMENT_PATTERN = r"(^|/)\.\.(/|$)"


def token_file_rules() -> list[JsonValue]:
    """`TokenFileData._path_on_volume`: with a claim, the file lies under the mount."""
    return [{
        "rule": ("!has(self.claimName) || (self.mountPath.startsWith('/') && "
                 "!self.mountPath.matches('" + PARENT_SEGMENT_PATTERN.replace("\\", "\\\\") +
                 "') && !self.path.matches('" + PARENT_SEGMENT_PATTERN.replace("\\", "\\\\") +
                 "') && !self.path.endsWith('/') && (self.mountPath.endsWith('/') ? "
                 "self.path.startsWith(self.mountPath) : "
                 "self.path.startsWith(self.mountPath + '/')))"),
        "message": ("with claimName, path must be a file inside mountPath (an absolute path), "
                    "with no '..' segments"),
    }]


def name_rules(max_chars: int, pattern: str) -> list[dict[str, str]]:
    """The job name: it names the rank pods (hostnames) and the Service."""
    return [{
        "rule": (f"!has(self.metadata.name) || (size(self.metadata.name) <= {max_chars} && "
                 f"self.metadata.name.matches('^{pattern}$'))"),
        "message": (f"metadata.name must be at most {max_chars} characters (rank pods are "
                    "<name>-rank-<i>, a 63-character hostname), start with a letter and hold "
                    "only lowercase letters, digits and '-'"),
    }]
