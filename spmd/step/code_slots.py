"""Where each graph of a cached step keeps its Inductor code: an entry of the compile cache per graph.

The step's artifact (``spmd.step.artifact``) is stored when the step is compiled, before its graphs are
lowered; the code Inductor makes for each graph (``spmd.lower.inductor_code``) comes later, on the
first call, and is stored then, as an entry of its own. Its digest is the step's key digest (which
covers the step, its inputs, the transformation and Inductor's settings, the versions and the GPU),
the graph's label and the devices its inputs live on: compiled code names its device, so a rank on
another GPU compiles its own.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..lower.inductor_code import InductorCode
from .cache_store import CacheStore

CODE_FORMAT = 1  # bumped when ``InductorCode`` changes


@dataclass
class CodeSlot:
    """One graph's entry: ``load`` what it holds (None if nothing usable), ``save`` new code."""

    store: CacheStore
    digest: str
    compiled_for: dict

    def load(self) -> Optional[InductorCode]:
        payload = self.store.load(self.digest)
        if not isinstance(payload, dict) or payload.get("format") != CODE_FORMAT:
            return None
        return payload["code"]

    def save(self, code: InductorCode) -> None:
        try:
            self.store.save(self.digest, {"format": CODE_FORMAT, "code": code, "compiled_for": self.compiled_for})
        except OSError as err:
            warnings.warn(f"spmd.compile: could not keep the compiled code under {self.store.root}: {err}; the step "
                          "runs, its graphs are compiled again next time.", RuntimeWarning, stacklevel=2)


def code_slots(store: CacheStore, step_digest: str, step_name: str) -> Callable[[str, tuple], CodeSlot]:
    """The slot of each graph (by label and example inputs) of the step whose key digest is ``step_digest``."""
    def slot(label: str, example_inputs: tuple) -> CodeSlot:
        devices = sorted({str(t.device) for t in example_inputs if isinstance(t, torch.Tensor)})
        text = "\n".join(["inductor code", step_digest, label, *devices])
        return CodeSlot(store, hashlib.sha256(text.encode()).hexdigest(),
                        {"step": step_name, "graph": label, "devices": devices, "step entry": step_digest[:16]})

    return slot
