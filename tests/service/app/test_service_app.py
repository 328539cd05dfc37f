"""The application builder's arguments, without starting Ray: validation, defaults, CPU/GPU."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

from service.app import AppArgs, build_app, use_gpu
from service.app.engine_app import ingress_settings


def test_command_line_strings_are_converted() -> None:
    args = AppArgs.model_validate({"model": "/ckpts/my-model/", "max_num_seqs": "8", "accelerator": "cpu"})
    assert args.max_num_seqs == 8
    assert args.resolved_name() == "my-model"
    assert AppArgs().resolved_name() == "transformer-base-trained"  # the default model is a preset
    assert AppArgs(model="transformer-base").resolved_name() == "transformer-base"
    assert AppArgs(served_model_name="x").resolved_name() == "x"


def test_serve_never_caps_the_batch_by_default() -> None:
    # Serve's own default of 5 ongoing requests would silently cap a 64-sequence batch.
    assert AppArgs(max_num_seqs=64).resolved_max_ongoing() == 80
    assert AppArgs(max_num_seqs=4).resolved_max_ongoing() == 8
    assert AppArgs(max_num_seqs=64, max_ongoing_requests=70).resolved_max_ongoing() == 70


@pytest.mark.parametrize("bad", [{"max_num_seq": 8}, {"accelerator": "tpu"}, {"block_size": 0},
                                 {"overload_status": 500}, {"num_replicas": 0},
                                 {"batch_dir": "/tmp/b", "models": [{"model": "transformer-base"}]},
                                 {"batch_dir": "memory://batches"}])
def test_bad_arguments_fail_at_build_time(bad: dict) -> None:
    with pytest.raises(ValidationError):
        call_user_app_builder_with_args_if_necessary(build_app, bad)


def test_batch_dir_is_made_absolute_and_takes_a_file_uri_or_an_installed_fsspec_filesystem(tmp_path,
                                                                                              monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # a replica's working directory is not this one: the path is fixed here
    assert AppArgs(batch_dir="batches").batch_dir == str(tmp_path / "batches")
    assert AppArgs(batch_dir=f"file://{tmp_path}/b").batch_dir == str(tmp_path / "b")
    assert AppArgs(batch_dir=f"local://{tmp_path}/c").batch_dir == f"local://{tmp_path}/c"  # fsspec's, as given
    import importlib.util

    if importlib.util.find_spec("s3fs") is None:  # the error names the package to install
        with pytest.raises(ValidationError, match=r"fsspec cannot open s3:// here \(Install s3fs"):
            AppArgs(batch_dir="s3://bucket/batches")
    with pytest.raises(ValidationError, match=r"memory:// lives in one process"):
        AppArgs(batch_dir="memory://batches")
    with pytest.raises(ValidationError, match=r"fsspec cannot open nope:// here"):
        AppArgs(batch_dir="nope://x")


def test_batch_offline_min_lines_needs_batch_dir_and_one_device_engines(tmp_path) -> None:
    with pytest.raises(ValidationError, match="batch_offline_min_lines needs batch_dir"):
        AppArgs(batch_offline_min_lines=100)
    with pytest.raises(ValidationError, match="with tensor_parallel_size > 1 leave it out"):
        AppArgs(batch_dir=str(tmp_path), batch_offline_min_lines=100, tensor_parallel_size=2)
    with pytest.raises(ValidationError):
        AppArgs(batch_dir=str(tmp_path), batch_offline_min_lines=0)
    args = AppArgs(batch_dir=str(tmp_path), batch_offline_min_lines=100, batch_offline_num_cpus=0.5)
    settings = ingress_settings(args)
    assert (settings.batch_offline_min_lines, settings.batch_offline_num_cpus) == (100, 0.5)


def test_a_max_model_len_the_cache_cannot_hold_fails_at_build_time_in_one_line() -> None:
    """A local model whose KV cache is sized in bytes: `serve run` stops before any replica starts,
    naming max_model_len and the largest value that fits; with that value the app builds."""
    block = 2 * 6 * 16 * 512 * 4  # transformer-base, float32 on the CPU
    args = {"model": "transformer-base", "kv_cache_memory_bytes": 10 * block, "accelerator": "cpu"}
    with pytest.raises(ValueError, match=r"^max_model_len 1024 does not fit .* Set max_model_len <= 160, ") as err:
        call_user_app_builder_with_args_if_necessary(build_app, args)
    assert "\n" not in str(err.value)
    call_user_app_builder_with_args_if_necessary(build_app, args | {"max_model_len": 160})


def test_accelerator_choice() -> None:
    assert use_gpu("gpu") is True
    assert use_gpu("cpu") is False
    # No Ray cluster attached: auto falls back to what torch sees on this machine.
    assert use_gpu("auto") is torch.cuda.is_available()


def test_auto_stays_on_the_cpu_with_a_cpu_build_of_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """`make serve` on a GPU machine without a CUDA torch: the cluster counts a GPU, but a replica
    asking for it would fail to start ('CUDA is not available'); auto serves on the CPU instead."""
    import ray

    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0, "GPU": 1.0})
    assert use_gpu("auto") is False
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert use_gpu("auto") is True
    assert use_gpu("cpu") is False
