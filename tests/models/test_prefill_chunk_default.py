"""model.prefill_chunk's default follows the backend: CUDA_PREFILL_CHUNK on cuda (chosen by the H200
measurement in docs/PERFORMANCE.md), 1024 elsewhere; a value set anywhere wins."""

from ignis_site import config


def test_cuda_gets_its_measured_chunk():
    assert (
        config.resolve(environ={"IGNIS_MODEL_BACKEND": "cuda"})[0]["model.prefill_chunk"] == config.CUDA_PREFILL_CHUNK
    )
    assert config.resolve(environ={"IGNIS_MODEL_BACKEND": "numpy"})[0]["model.prefill_chunk"] == 1024
    set_env = {"IGNIS_MODEL_BACKEND": "cuda", "IGNIS_MODEL_PREFILL_CHUNK": "512"}
    assert config.resolve(environ=set_env)[0]["model.prefill_chunk"] == 512
    saved = config.resolve(environ={"IGNIS_MODEL_BACKEND": "cuda"}, saved={"model.prefill_chunk": 1024})[0]
    assert saved["model.prefill_chunk"] == 1024
