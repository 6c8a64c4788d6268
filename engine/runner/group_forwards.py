"""GroupForwards: one step's denoise forwards, one per shape group of the step's batch.

Called by the model runner every step. The step's requests are split by ``BatchKey`` (their
token grid) into shape groups, in the plan's order; each group becomes one ``InputBatch`` (its
own builder, so static rows and buffers are reused while the group's composition is
unchanged) and one ``pipeline.denoise_step``. How the forwards run is a choice made once:

- under layerwise offload, block-major (``BlockMajor``): every group through each streamed
  block while it is in its device slot, all of it inside the offload's ``one_pass`` scope, so
  a step moves one pass of weights whatever its mix of shapes;
- resident, one forward after the other (nothing to share: the weights stay on the device).

Each forward carries its rows' LoRA adapters (``engine.adapters.rows``): requests with
different adapters share a group and its forward.

A group whose inputs are refused or whose forward raises fails on its own; the others' results
stand. The runner decides what a failure means for the group's requests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ditserve.engine.adapters import rows
from ditserve.engine.pipelines import StepPipeline
from ditserve.engine.request import BatchKey
from ditserve.engine.runner.block_major import BlockMajor, call
from ditserve.engine.step.denoise_state import DenoiseState
from ditserve.engine.step.input_batch import InputBatch, InputBatchBuilder


def shape_groups(states: Sequence[DenoiseState]) -> list[list[DenoiseState]]:
    """``states`` by BatchKey, groups in order of first appearance, members in order."""
    groups: dict[BatchKey, list[DenoiseState]] = {}
    for state in states:
        groups.setdefault(state.params.batch_key(), []).append(state)
    return list(groups.values())


@dataclass
class GroupForward:
    """One group's forward: its inputs and prediction, (rows, ...) in the inputs' order, or
    the error that stopped it (inputs None: the batch itself was refused)."""

    states: list[DenoiseState]
    inputs: InputBatch | None = None
    prediction: torch.Tensor | None = None
    error: Exception | None = None


class GroupForwards:
    """Runs a step's shape groups (see module docstring)."""

    def __init__(
        self,
        pipeline: StepPipeline,
        *,
        block_major: BlockMajor | None = None,
        one_pass: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
        around: Callable[[InputBatch], contextlib.AbstractContextManager[None]] | None = None,
    ) -> None:
        """block_major: run the forwards in lockstep over these block barriers (offload);
        None runs them in turn. one_pass: the offload's scope that makes them one pass.
        around: a scope entered inside each group's forward (in its own lane), given the
        group's inputs (the step cache's per-forward rows)."""
        self.pipeline = pipeline
        self.block_major = block_major
        self._one_pass = one_pass or contextlib.nullcontext
        self._around = around
        self._builders: dict[BatchKey, InputBatchBuilder] = {}

    def run(self, groups: Sequence[list[DenoiseState]]) -> list[GroupForward]:
        results = [GroupForward(list(states)) for states in groups]
        keys = [states[0].params.batch_key() for states in groups]
        # Builders of groups that left the batch go (their buffers with them).
        self._builders = {key: self._builders.get(key) or InputBatchBuilder() for key in keys}
        for key, result in zip(keys, results, strict=True):
            try:
                result.inputs = self._builders[key].build(result.states)
            except Exception as e:  # a refused batch fails its group only
                result.error = e
        ready = [r for r in results if r.inputs is not None]
        forwards = [self._forward(r.inputs) for r in ready if r.inputs is not None]
        with self._one_pass():
            if self.block_major is not None:
                outcomes = self.block_major.run(forwards)
            else:
                outcomes = [call(forward) for forward in forwards]
        for result, outcome in zip(ready, outcomes, strict=True):
            result.prediction, result.error = outcome.value, outcome.error
        return results

    def _forward(self, inputs: InputBatch) -> Callable[[], torch.Tensor]:
        # Each row's LoRA adapters for the adapted linears' hooks (engine.adapters), set
        # inside the forward: a block-major lane runs in a greenlet with its own context.
        adapters = rows.of_requests([s.params for s in inputs.states], inputs.row_slices,
                                    inputs.num_rows)

        around = self._around or (lambda _: contextlib.nullcontext())

        def forward() -> torch.Tensor:
            with rows.applying(adapters), around(inputs):
                return self.pipeline.denoise_step(inputs)

        return forward
