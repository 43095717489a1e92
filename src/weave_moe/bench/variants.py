"""Variant names: the one parser of `backend[:policy]` strings, used by `weave-moe bench` and `weave_moe.validate`.

    "nccl"                -> Variant("nccl", backend="nccl", policy=None)
    "weave"               -> Variant("weave", backend="weave", policy="weave")       (the backend's default policy)
    "weave:static:20,4"   -> Variant("weave:static:20,4", backend="weave", policy="static:20,4")
    "nccl,weave:static:20,4,weave" (a list) -> three variants: a part that is only digits belongs to the one before
    "weave:serial@independent_scan=off@decode_stages=off"
                          -> the weave backend with KernelConfig overrides (`key=value` after each "@", on top of
                             WEAVE_MOE_KERNEL_CONFIG): A/B of kernel configurations side by side in one run

A backend name must be registered in `weave_moe.layer.BACKENDS`; a policy is allowed on the weave backend only and is
checked by `weave_moe.plan.parse_policy`, so a typo fails before any rank starts, with the valid names in the message.
"""

from __future__ import annotations

from dataclasses import dataclass

from weave_moe.plan.calibrate import WEAVE_POLICIES  # the weave policies of the default comparison

__all__ = ["Variant", "parse_variant", "parse_variants", "BASELINES", "WEAVE_POLICIES", "default_variants"]

#: The baselines a user would run instead of weave, in report order. The best of them (per configuration) is what the
#: report ranks every variant against.
BASELINES = ("nccl", "symm", "deepep")

#: KernelConfig settings of a weave variant under `--emulate-ep` (below the environment's and the variant's own)
EMULATED_KERNEL_CONFIG = "serial_at_ep1=off"



@dataclass(frozen=True)
class Variant:
    """One column of the comparison: a backend and, for weave, a schedule policy.

    Attributes:
        name: the text it was parsed from ("weave:static:20"); the row's `variant`.
        backend: a key of `weave_moe.layer.BACKENDS`.
        policy: the weave policy ("weave" when none was given); None for the other backends.
        kernel_config: KernelConfig overrides of a weave variant, "key=value,..." ("" = none).
    """

    name: str
    backend: str
    policy: str | None = None
    kernel_config: str = ""

    @property
    def is_baseline(self) -> bool:
        return self.backend in BASELINES

    def layer_options(self, emulated: bool = False) -> dict:
        """The `ExpertParallelMoE` keyword arguments this variant sets: its policy, and with overrides its
        KernelConfig (WEAVE_MOE_KERNEL_CONFIG's, then the variant's: a key in both takes the variant's value).
        `emulated`: the layer runs at EP = 1 one rank's work of a larger EP (`--emulate-ep`), so a weave layer
        plans on the device as that rank would (KernelConfig.serial_at_ep1 off, under the two above)."""
        options = {} if self.policy is None else dict(policy=self.policy)
        base = EMULATED_KERNEL_CONFIG if emulated and self.backend == "weave" else ""
        if self.kernel_config or base:
            options["config"] = _kernel_config(self.name, self.kernel_config, base)
        return options


def _known_backends() -> tuple[str, ...]:
    from weave_moe.layer import BACKENDS

    return tuple(BACKENDS)


def _kernel_config(name: str, overrides: str, base: str = ""):
    """KernelConfig of `base`, then WEAVE_MOE_KERNEL_CONFIG, then `overrides` (a later key wins)."""
    import os

    from weave_moe.backends.weave.config import KERNEL_CONFIG_ENV, KernelConfig

    return KernelConfig.from_text(",".join((base, os.environ.get(KERNEL_CONFIG_ENV, ""), overrides)),
                                  f"variant {name!r} (with {KERNEL_CONFIG_ENV})")


def parse_variant(text: str) -> Variant:
    """One `backend[:policy][@key=value...]` name -> Variant; ValueError naming what is allowed."""
    from weave_moe.plan import parse_policy

    text = text.strip()
    if not text:
        raise ValueError("empty variant name; expected backend[:policy], e.g. nccl or weave:static:20")
    head, *overrides = text.split("@")
    if overrides:
        variant = parse_variant(head)
        if variant.backend != "weave":
            raise ValueError(f"variant {text!r}: only the weave backend takes @key=value kernel settings")
        if not all(overrides):
            raise ValueError(f"variant {text!r}: an empty @ setting; expected e.g. weave:serial@decode_stages=off")
        settings = ",".join(overrides)
        _kernel_config(text, settings)   # a typo fails here, before any rank starts
        return Variant(name=text, backend=variant.backend, policy=variant.policy, kernel_config=settings)
    backend, _, policy = text.partition(":")
    known = _known_backends()
    if backend not in known:
        raise ValueError(f"variant {text!r}: unknown backend {backend!r}; registered backends: {', '.join(known)}")
    if backend != "weave":
        if policy:
            raise ValueError(f"variant {text!r}: only the weave backend takes a policy; use {backend!r} alone")
        return Variant(name=text, backend=backend)
    policy = policy or "weave"
    try:
        parse_policy(policy)
    except ValueError as error:  # its message lists the valid policies
        raise ValueError(f"variant {text!r}: {error}") from None
    return Variant(name=text, backend=backend, policy=policy)


def parse_variants(text: str) -> list[Variant]:
    """A comma-separated list of variant names (a `--variants` value). 'weave:static:20,4' keeps its comma: a part
    that is only digits joins the one before it. Duplicates are an error (their rows would be indistinguishable)."""
    names: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if names and part.partition("@")[0].isdigit():
            names[-1] += "," + part
        else:
            names.append(part)
    if not names:
        raise ValueError(f"no variant in {text!r}; expected e.g. nccl,weave:serial,weave")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"variant(s) given twice: {', '.join(duplicates)}")
    return [parse_variant(name) for name in names]


def default_variants() -> str:
    """Every registered baseline, then weave with each policy of WEAVE_POLICIES (the last one, 'weave', as plain
    'weave'), as a --variants string."""
    known = _known_backends()
    names = [b for b in BASELINES if b in known]
    if "weave" in known:
        names += [f"weave:{p}" if p != "weave" else "weave" for p in WEAVE_POLICIES]
    return ",".join(names)
