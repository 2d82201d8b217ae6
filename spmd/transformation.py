"""GraphModuleTransformation: the default thing done to a traced, expanded step graph."""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch.fx as fx

from graph_utils import dump_graphs_to_files

from .iter_graph_module import IterGraphModule

log = logging.getLogger(__name__)


class GraphModuleTransformation:
    """Wrap the step graph in an ``IterGraphModule`` and optionally dump it.

    ``enable_graph_optimization`` (the comm/overlap pass pipeline) and
    ``enable_inductor`` (lowering) are not implemented yet and raise
    ``NotImplementedError`` when asked for, so nothing silently runs unoptimized.
    ``dump_graphs=True`` writes the traced and the setup/main/cleanup graphs to
    ``dump_dir`` (default ``$SPMD_DUMP_DIR`` or ``./spmd_dump``).
    """

    def __init__(self, enable_graph_optimization: bool = False, enable_inductor: bool = False,
                 dump_graphs: bool = False, dump_dir: Optional[str] = None):
        if enable_graph_optimization:
            raise NotImplementedError(
                "GraphModuleTransformation(enable_graph_optimization=True): the comm fusion / wait "
                "scheduling pass pipeline is not implemented yet."
            )
        if enable_inductor:
            raise NotImplementedError(
                "GraphModuleTransformation(enable_inductor=True): Inductor lowering of the whole step is "
                "not implemented yet."
            )
        self.dump_graphs = dump_graphs
        self.dump_dir = dump_dir or os.environ.get("SPMD_DUMP_DIR") or "spmd_dump"

    def __call__(self, gm: fx.GraphModule) -> IterGraphModule:
        igm = IterGraphModule(gm)
        igm.finalize_setup()
        if self.dump_graphs:
            paths = dump_graphs_to_files(
                {"00_traced": gm, "01_setup": igm.setup_gm, "02_main": igm.main_gm, "03_cleanup": igm.cleanup_gm},
                self.dump_dir,
            )
            log.info("spmd: wrote %d graph dump files to %s", len(paths), self.dump_dir)
        return igm
