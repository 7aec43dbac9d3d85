"""Which compile options the farm treats apart, declared once for the server (the API, the
web form, a sweep's compiles) and for `qpcfarm submit`. Plain names of `CompileOptions`
fields (the flag of each is `compiler_core.options.spec_for(name).flag`); no imports, so the
console reads it without the service's stack."""

from __future__ import annotations

MODEL_FILE_OPTIONS = (
    "network_specialization_config",
    "custom_io_list_file",
    "node_precision_info",
    "load_profile",
    "input_list_file",
)
"""Options whose value is a file: on the farm, a file inside the model's upload (so the cache
key covers its bytes: a quantization profile and the calibration inputs too); `qpcfarm
submit` uploads the local file in the model's archive, beside the model."""

SERVER_SIDE_OPTIONS = {
    "model": "the model is the upload named by `model_id`",
    "aic_binary_dir": "the QPC is stored by the farm: download it from /v1/qpcs/{id}/download",
    "operators_supported": "see GET /v1/operators",
}
"""Options that name paths on the machine running the compile, with why the farm refuses them
over the network."""
