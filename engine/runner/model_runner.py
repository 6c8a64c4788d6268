"""ModelRunner: executes StepPlans on one device; owns the pipeline and per-request tensors.

Called only from the engine's step loop. One ``execute(plan)`` encodes the newly admitted requests,
runs the plan's batch through the denoise forwards - one per shape group, block-major under
layerwise offload (``group_forwards``) - applies each request's own sampler step, and decodes the
requests that just finished. On CUDA all of it is queued, and ``execute`` returns once the
*previous* step has finished (``InFlightSteps``), so the GPU always has the next step while the
host prepares the one after (decoded pixels and step times come one call late). Failures are
isolated: a request that fails to encode or decode fails alone; if a group's forward fails, each of
its requests is retried alone so only the culprit fails (the other groups' results stand).

With sequence parallelism (``sequence_group``) the DiT's forward runs on this process's share
of the tokens (``engine.parallel``): every process of the SP group executes the same plans,
so each holds the same request states; only the group's leader decodes (and previews), and
a batched forward that fails fails its whole batch (a retry alone would run all-to-alls the
other ranks do not join).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ditserve.engine.config import RunnerConfig
from ditserve.engine.errors import AdapterError, InvalidRequestError
from ditserve.engine.pipelines import StepPipeline
from ditserve.engine.pipelines.base import decode_preview
from ditserve.engine.pipelines.capabilities import (
    BatchedConditions,
    condition_images_of,
    model_limits_of,
    work_rule_of,
)
from ditserve.engine.request import ModelLimits, NewRequest
from ditserve.engine.runner.assembly import (
    PlanSettings,
    load_and_assemble,
    resolve_device,
    with_fitted_settings,
)
from ditserve.engine.runner.block_major import BlockMajor
from ditserve.engine.runner.group_forwards import GroupForward, GroupForwards, shape_groups
from ditserve.engine.runner.inflight import InFlightSteps
from ditserve.engine.runner.plan_point import PlanPoint
from ditserve.engine.runner.start_phases import StartTimeline, timed
from ditserve.engine.step.denoise_state import DenoiseState
from ditserve.engine.step.plan import RunnerOutput, StepPlan
from ditserve.engine.step_cache.runtime import StepCache

log = logging.getLogger(__name__)


class ModelRunner:
    """Owns the loaded pipeline, the optional offload handle and every request's DenoiseState."""

    def __init__(
        self,
        config: RunnerConfig,
        *,
        model_dir: str | Path,
        device: torch.device | None = None,
        weight_group: Any = None,
        sequence_group: Any = None,
        timeline: StartTimeline | None = None,
    ) -> None:
        """config: this rank's part of the replica's config (``RunnerConfig.of``, offload
        resolved). device: overrides ``config.device`` (each DP rank its own). weight_group:
        the group DLO shards weights over (None: rank-local). sequence_group: the SP group of
        this DP rank's forwards (None: the whole sequence here). timeline: records the start
        phases (cuda_init, read, place, pin_register, encoders); None records nothing."""
        self.device = device if device is not None else resolve_device(config.device)
        self._sequence: Any = None
        if sequence_group is not None:
            from ditserve.engine.parallel import SequenceGroup

            self._sequence = SequenceGroup.of(sequence_group)
        # Only an SP group's leader decodes: its output is the DP rank's (the executor drops
        # the followers'), so the followers skip the VAE and send no pixels back.
        self._decodes = self._sequence is None or self._sequence.rank == 0
        started = time.perf_counter()
        if config.compile is not None:
            from ditserve.engine.runner.compiled_blocks import require_toolchain

            require_toolchain(config.compile, self.device)  # before minutes of loading
        offload = config.offload
        settings = PlanSettings(scheduler=config.scheduler, pipeline=config.pipeline,
                                offload=offload)
        built = load_and_assemble(
            model_dir, dtype=config.dtype, checkpoint=config.checkpoint,
            sp_size=config.sequence_parallel_size, quantization=config.quantization,
            adapters=config.adapters, compile=config.compile, settings=settings,
            device=self.device, sequence=self._sequence, weight_group=weight_group,
            timeline=timeline)
        self.pipeline: StepPipeline = built.pipeline
        self.adapters, self.offload, self.budget = built.adapters, built.offload, built.budget
        # As the budget lowered them (the engine schedules by the lowered scheduler).
        settings = with_fitted_settings(settings, built.budget)
        self.config = config = dataclasses.replace(config, scheduler=settings.scheduler,
                                                   pipeline=settings.pipeline)
        log.info("loaded %s from %s on %s in %.1fs (offload: %s)", built.pipeline_class,
                 model_dir, self.device, time.perf_counter() - started,
                 "dlo" if offload.enabled else "off")
        from ditserve.engine.placement.whole_pipeline import WholePipeline
        # Encoders parked, prompt cache, VAE tiling, and the one printed plan (issue 34).
        with timed(timeline, "encoders"):
            self.whole = WholePipeline(self.pipeline, pipeline_config=config.pipeline,
                                       offload=offload, device=self.device,
                                       offload_report=self.offload_report(),
                                       inputs=built.inputs, budget=built.budget,
                                       encode_prompts=2 * config.scheduler.max_num_seqs)
        log.info("pipeline plan:\n%s", self.whole.plan_table())
        self._states: dict[str, DenoiseState] = {}
        # Wraps the blocks beneath every hook (offload, compile, SP): built after all of them.
        self.step_cache = StepCache(self.pipeline, default=config.step_cache.spec(),
                                    offload=self.offload,
                                    sequence_parallel=self._sequence is not None)
        # Under offload a step's shape groups run block-major, as one pass; resident, one
        # after the other (the weights do not move: nothing to share).
        self._block_major = (BlockMajor(self.pipeline.transformer, self.pipeline.block_lists)
                             if offload.enabled else None)
        one_pass = self.offload.one_pass if self.offload is not None else None
        self._forwards = GroupForwards(self.pipeline, block_major=self._block_major,
                                       one_pass=one_pass, around=self.step_cache.scope)
        self.work_rule = work_rule_of(self.pipeline)
        self._inflight = InFlightSteps(self.device)
        self.plan_point = PlanPoint(  # when the loop may plan the next step (scheduler.plan_at)
            self.pipeline.transformer, self.pipeline.block_lists, config.scheduler.plan_at,
            device=self.device, compiled=config.compile is not None)

    @property
    def limits(self) -> ModelLimits:
        """What the loaded model can run (``capabilities.model_limits_of``)."""
        return model_limits_of(self.pipeline)

    @property
    def pixel_multiple(self) -> int:
        return int(self.pipeline.pixel_multiple)

    @property
    def max_prompt_chars(self) -> int | None:
        return self.pipeline.max_prompt_chars

    @property
    def frame_step(self) -> int | None:
        """None for an image model; for video, ``num_frames - 1`` must divide by it."""
        return self.pipeline.frame_step

    @property
    def condition_images(self) -> tuple[int, int]:
        """(fewest, most) conditioning images; families without any declare nothing."""
        return condition_images_of(self.pipeline)

    def offload_report(self) -> dict[str, Any] | None:
        return self.offload.report() if self.offload is not None else None

    def pipeline_report(self) -> dict[str, Any]:
        """Where each component lives and the prompt cache's counters (``WholePipeline``)."""
        return self.whole.report()

    def close(self) -> None:
        self.plan_point.close()
        self.whole.close()
        self.step_cache.close()
        if self._block_major is not None:
            self._block_major.close()
        if self.offload is not None and self.offload.active:
            self.offload.disable()

    # -- request registry ---------------------------------------------------------------------
    def add_request(self, new: NewRequest) -> None:
        self.adapters.acquire(new.params.loras)  # resident while the request runs
        state = DenoiseState(new.request_id, new.params, new.seed)
        self.step_cache.attach(state)
        self._states[new.request_id] = state

    def _pop(self, request_id: str) -> DenoiseState | None:
        state = self._states.pop(request_id, None)
        self.step_cache.forget(request_id)
        if state is not None:
            self.adapters.release(state.params.loras)
        return state

    def drop(self, request_id: str) -> None:
        self._pop(request_id)
        self._inflight.forget(request_id)

    # -- one step -----------------------------------------------------------------------------
    def execute(
        self,
        plan: StepPlan,
        new_requests: Sequence[NewRequest] = (),
        *, upcoming: Sequence[NewRequest] = (), collective_wave: bool = False,
    ) -> RunnerOutput:
        """Run one step. ``new_requests``: the plan's admitted requests; ``upcoming``: those
        next in line, whose prompts this step's encoder pass may take (``StepPlan.upcoming``).

        collective_wave: another rank runs a forward in this step; if this rank has no batch
        and its offload shares weights through a collective, it still joins every block's
        collective (without computing) so the ranks' collectives stay matched.
        """
        out = RunnerOutput()
        for rid in plan.freed:  # first: their adapters' room is what admission counted
            self.drop(rid)
        for new in new_requests:
            try:
                self.add_request(new)
            except AdapterError as e:  # an adapter file that cannot serve fails its request
                log.error("request %s: %s", new.request_id, e)
                out.failed[new.request_id] = f"adapter: {e}"
            except InvalidRequestError as e:  # the engine's validation refuses these first
                out.failed[new.request_id] = str(e)
        self._encode_conditions(plan.encode)
        encoding = [rid for rid in plan.encode if rid not in out.failed]
        # The admitted requests' prompts in one encoder pass (cache misses; the next ones' too).
        with self._inflight.timed_part("encode", len(encoding)), self.whole.encoding(
                [self._states[r] for r in encoding if r in self._states], upcoming):
            for rid in encoding:
                self._guarded(out, rid, "encode", self.pipeline.prepare_encode)
        batch = [self._states[rid] for rid in plan.denoise if rid not in out.failed]
        passes = self._collective_passes()
        if batch:
            groups = shape_groups(batch)
            self._inflight.forward_started()
            with self.step_cache.step(out):
                self._denoise(groups, out)
            self._inflight.forward_ended(
                requests=len(batch), rows=sum(s.rows for s in batch), groups=len(groups),
                tokens=sum(s.rows * self.work_rule.tokens_per_row(s.params) for s in batch))
            self._previews(batch, out)
        if collective_wave and passes is not None and self._collective_passes() == passes:
            # No forward reached the transformer here (no batch, or it failed before):
            # still join every block's collective, exactly once per step like the others.
            self.offload.idle_pass()
            self._inflight.work_queued()
        self._decode([rid for rid in plan.decode if rid not in out.failed], out)
        for step in self._inflight.close():
            out.finished.update(step.decodes)
            out.audio.update(step.audio)
            if step.rows:
                out.forward_requests, out.forward_rows = step.requests, step.rows
                out.forward_groups, out.forward_tokens = step.groups, step.tokens
                out.forward_seconds = step.seconds
        return out

    def _encode_conditions(self, rids: Sequence[str]) -> None:
        """Image-conditioned families encode the admitted requests' images in one batch
        (``encode_conditions``); on failure each request's own ``prepare_encode`` encodes
        (and fails) alone, so one bad image never fails its neighbours."""
        states = [self._states[rid] for rid in rids if rid in self._states]
        if not isinstance(self.pipeline, BatchedConditions) or len(states) < 2:
            return
        try:
            self.pipeline.encode_conditions(states)
        except Exception:
            log.warning("batched conditioning encode failed; encoding per request", exc_info=True)

    def _decode(self, rids: list[str], out: RunnerOutput) -> None:
        """Decode the finished requests, same shapes batched (``WholePipeline.decode``); on
        an SP follower only forget them (the group's leader decodes)."""
        if not self._decodes:
            for rid in rids:
                self._pop(rid)
            out.decoded.extend(rids)
            return
        missing = [rid for rid in rids if rid not in self._states]
        out.failed.update({rid: "decode: request state missing" for rid in missing})
        states = [self._states[rid] for rid in rids if rid not in missing]
        with self._inflight.timed_part("decode", len(states)):
            failed = self.whole.decode(states) if states else {}
        out.failed.update(failed)
        for state in states:
            if state.request_id not in failed:
                self._pop(state.request_id)
                out.decoded.append(state.request_id)
                self._inflight.add_decode(state.request_id, state.pixels, state.audio,
                                          state.audio_rate)

    def _collective_passes(self) -> int | None:
        """Passes run by an offload whose loads are collectives (None: not such an offload)."""
        if self.offload is None or not self.offload.needs_collective_participation:
            return None
        return int(self.offload.passes)

    def _guarded(self, out: RunnerOutput, rid: str, stage: str, fn: Any) -> bool:
        state = self._states.get(rid)
        if state is None:
            out.failed[rid] = f"{stage}: request state missing"
            return False
        try:
            fn(state)
        except Exception as e:  # isolate: this request fails, the engine keeps serving
            log.exception("request %s failed in %s", rid, stage)
            out.failed[rid] = f"{stage} failed: {type(e).__name__}: {e}"
            return False
        return True

    def _denoise(self, groups: list[list[DenoiseState]], out: RunnerOutput) -> None:
        for group in self._forwards.run(groups):
            if group.error is not None:
                self._group_failed(group, out)
                continue
            assert group.inputs is not None and group.prediction is not None
            for state, rows in zip(group.states, group.inputs.split(group.prediction),
                                   strict=True):
                if self._guarded(out, state.request_id, "step",
                                 lambda s, r=rows: self.pipeline.step(s, r)):
                    out.stepped.append(state.request_id)
                    self.step_cache.stepped(state)

    def _group_failed(self, group: GroupForward, out: RunnerOutput) -> None:
        e = group.error
        if (len(group.states) == 1 or self._collective_passes() is not None
                or self._sequence is not None):
            # Alone, or with AllGather offload or sequence parallelism, where a retry would
            # run extra passes or all-to-alls the other ranks do not join: the group fails
            # together.
            log.error("request %s failed in denoise",
                      ", ".join(s.request_id for s in group.states), exc_info=e)
            for state in group.states:
                out.failed[state.request_id] = f"denoise failed: {type(e).__name__}: {e}"
            return
        # Find the culprit: no state was advanced, so rerun each request alone.
        log.warning("a batched forward failed (%s: %s); retrying %d requests one by one",
                    type(e).__name__, e, len(group.states))
        for state in group.states:
            self._denoise([[state]], out)

    # -- previews (partial images) --------------------------------------------------------------
    def _previews(self, batch: list[DenoiseState], out: RunnerOutput) -> None:
        """Decode a preview for each request that just reached one of its preview steps."""
        if not self._decodes:
            return
        for state in batch:
            rid = state.request_id
            if rid not in out.stepped or state.step_index not in state.params.preview_steps:
                continue
            try:
                out.previews[rid] = (state.step_index, decode_preview(self.pipeline, state))
            except Exception:  # a preview is a courtesy: losing one must not fail the request
                log.exception("request %s: preview after step %d failed", rid, state.step_index)
        if out.previews and self.device.type == "cuda":
            # The previews' copies to the host are queued; they are read as soon as this step
            # returns. Only steps with a preview wait here (at most 3 per request).
            torch.cuda.current_stream(self.device).synchronize()
