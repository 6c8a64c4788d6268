"""The host plan of a load (engine/weights/host_fit.py), fed fake memory and filesystem facts.

The FLUX.2 [dev] case of issue 46: a 125 GiB host, the 60 GiB DiT and the 45 GiB Mistral
encoder in a /dev/shm tmpfs (MemAvailable ~17 GiB left). Before the plan existed, ``auto``
copied the DiT into 60 GiB of private pinned memory beside its tmpfs pages and the kernel
killed the engine while loading.
"""

from __future__ import annotations

from ditserve.engine.weights.host_fit import (
    GIB,
    CgroupMemory,
    ComponentFiles,
    DitBacking,
    HostMemory,
    LoadOptions,
    plan_host_fit,
)

DIT_TMPFS = ComponentFiles("transformer", 60 * GIB, "tmpfs")
DIT_DISK = ComponentFiles("transformer", 60 * GIB, "ext4")
TE_TMPFS = ComponentFiles("text_encoder", 45 * GIB, "tmpfs")
TE_DISK = ComponentFiles("text_encoder", 45 * GIB, "ext4")
VAE = ComponentFiles("vae", GIB // 4, "tmpfs")
ALL_IN_SHM = HostMemory(17 * GIB)  # 125 GiB host, 104 GiB of it the tmpfs
TE_SPILLED = HostMemory(62 * GIB)  # the encoder's 45 GiB on a local disk instead
BASELINE = LoadOptions(encoders_offloaded=False)  # dlo-resident-encoders, CUDA rank-local
WHOLE = LoadOptions(encoders_offloaded=True)  # dlo-whole


def test_auto_maps_and_registers_a_dit_checkpoint_on_tmpfs() -> None:
    fit = plan_host_fit([DIT_TMPFS], [TE_TMPFS], [VAE], ALL_IN_SHM, BASELINE)
    assert fit.dit is DitBacking.MAPPED_REGISTERED
    assert fit.auto_pin and fit.pin_limit_bytes >= DIT_TMPFS.bytes
    assert fit.committed == 0 and fit.fits
    assert "tmpfs" in fit.reason and "twice" in fit.reason


def test_a_private_copy_of_a_tmpfs_checkpoint_is_refused_with_the_flag_that_fits() -> None:
    fit = plan_host_fit([DIT_TMPFS], [TE_TMPFS], [VAE], ALL_IN_SHM,
                        LoadOptions(mmap="off", encoders_offloaded=False))
    assert fit.dit is DitBacking.PRIVATE and not fit.fits
    assert fit.committed == 60 * GIB
    message = fit.refusal()
    assert "60.0 GiB" in message and "17.0 GiB is available" in message
    assert fit.remedies == ("--dlo-checkpoint-mmap auto",)
    assert "--dlo-checkpoint-mmap auto" in message


def test_streamed_encoder_on_tmpfs_does_not_fit_and_the_remedies_say_what_would() -> None:
    fit = plan_host_fit([DIT_TMPFS], [TE_TMPFS], [VAE], ALL_IN_SHM, WHOLE)
    assert not fit.fits
    assert fit.committed == 45 * GIB  # the encoder's pinned layers; the DiT commits nothing
    assert len(fit.remedies) == 2
    assert fit.remedies[0].startswith("--dlo-components dit")
    assert "text_encoder on a local disk" in fit.remedies[1]


def test_the_encoder_spilled_to_disk_fits_the_whole_pipeline() -> None:
    fit = plan_host_fit([DIT_TMPFS], [TE_DISK], [VAE], TE_SPILLED, WHOLE)
    assert fit.fits and fit.dit is DitBacking.MAPPED_REGISTERED
    rows = {h.name: h for h in fit.holdings}
    assert rows["text_encoder"].committed == 45 * GIB
    assert rows["transformer"].committed == 0
    assert "fits" in fit.table() and "text_encoder" in fit.table()


def test_a_disk_checkpoint_is_copied_when_that_fits_else_streamed_from_its_page_cache() -> None:
    roomy = plan_host_fit([DIT_DISK], [], [], HostMemory(100 * GIB), BASELINE)
    assert roomy.dit is DitBacking.PRIVATE and roomy.committed == 60 * GIB and roomy.fits
    tight = plan_host_fit([DIT_DISK], [], [], HostMemory(40 * GIB), BASELINE)
    assert tight.dit is DitBacking.MAPPED_STAGING and tight.committed == 0 and tight.fits
    assert not tight.auto_pin and tight.pin_limit_bytes == 0
    assert "2x slower" in tight.reason


def test_a_registered_disk_checkpoint_locks_its_pages() -> None:
    options = LoadOptions(pin_limit_bytes=64 * GIB, encoders_offloaded=False)
    fit = plan_host_fit([DIT_DISK], [], [], HostMemory(40 * GIB), options)
    assert fit.dit is DitBacking.MAPPED_REGISTERED and not fit.auto_pin
    assert fit.committed == 60 * GIB and not fit.fits
    assert any(r.startswith("--dlo-pin-limit-gib 0") for r in fit.remedies)


def test_a_cgroup_limit_bounds_what_is_available() -> None:
    pod = CgroupMemory("/kubepods/pod1", limit=32 * GIB, usage=20 * GIB, reclaimable=4 * GIB)
    memory = HostMemory(100 * GIB, (pod,))
    assert memory.available == 16 * GIB  # the limit minus the working set (usage - inactive)
    fit = plan_host_fit([DIT_DISK], [], [], memory, BASELINE)
    assert fit.dit is DitBacking.MAPPED_STAGING  # a 60 GiB copy fits the host, not the pod
    assert "cgroup /kubepods/pod1" in fit.table()


def test_private_copies_count_once_per_process_and_shards_once_per_host() -> None:
    disk = [ComponentFiles("transformer", 10 * GIB, "ext4")]
    two = plan_host_fit(disk, [], [], HostMemory(100 * GIB),
                        LoadOptions(processes=2, encoders_offloaded=False))
    assert two.dit is DitBacking.PRIVATE and two.committed == 20 * GIB
    sharded = plan_host_fit(disk, [], [], HostMemory(100 * GIB),
                            LoadOptions(processes=2, sharded=True, registers=False,
                                        encoders_offloaded=False))
    assert sharded.committed == 10 * GIB


def test_kept_private_and_cast_checkpoints_load_privately() -> None:
    quantized = plan_host_fit([DIT_TMPFS], [], [], HostMemory(100 * GIB),
                              LoadOptions(keep_private="--quantization fp8",
                                          encoders_offloaded=False))
    assert quantized.dit is DitBacking.PRIVATE and "fp8" in quantized.reason
    cast = ComponentFiles("transformer", 10 * GIB, "tmpfs", cast=True)
    fit = plan_host_fit([cast], [], [], HostMemory(100 * GIB), BASELINE)
    assert fit.dit is DitBacking.PRIVATE and fit.committed == 10 * GIB


def test_a_cpu_device_reads_the_mapping_and_commits_nothing_for_the_dit() -> None:
    fit = plan_host_fit([DIT_DISK], [], [], HostMemory(GIB),
                        LoadOptions(registers=False, encoders_offloaded=False))
    assert fit.dit is DitBacking.MAPPED and fit.committed == 0 and fit.fits


def test_nothing_fits_says_so() -> None:
    fit = plan_host_fit([DIT_TMPFS], [TE_DISK], [], HostMemory(10 * GIB), WHOLE)
    assert not fit.fits and len(fit.remedies) == 1
    assert fit.remedies[0].startswith("--dlo-components dit")
    stored_fp32 = ComponentFiles("text_encoder", 45 * GIB, "ext4", cast=True)  # cast: private
    small = plan_host_fit([DIT_DISK], [stored_fp32], [], HostMemory(GIB), WHOLE)
    assert not small.fits and small.remedies == ()
    assert "nothing this engine can choose fits" in small.refusal()


def test_a_load_that_commits_nothing_is_never_refused() -> None:
    fit = plan_host_fit([DIT_TMPFS], [TE_TMPFS], [VAE], HostMemory(0), BASELINE)
    assert fit.committed == 0 and fit.headroom == 0 and fit.fits
