"""The architectures `real_models.py` exports: transformers and timm models with random weights
built from configs in code (nothing is fetched from a hub), small enough for the functional
runtime, and with no branch left dead by its initialisation.

Two traps of random initialisation are handled in `revive`: timm zero-initialises the last
BatchNorm of residual branches (and BatchNorm statistics start at mean 0, variance 1), and
ConvNeXt-style layer scales start at 1e-6; either leaves a branch contributing nothing, and a
comparison against ONNX Runtime would then test nothing. `revive` gives every BatchNorm random
statistics and affine parameters and every near-zero scale parameter a real size.

timm: version 0.6.13 is the newest whose model code imports without torchvision (later ones
import `torchvision.ops.misc.FrozenBatchNorm2d` in `timm.layers`, and no torchvision wheel
imports beside torch 2.13's CPU build here). Its models import only constants from `timm.data`,
whose package `__init__` pulls the data pipeline (PIL, torchvision transforms); `import_timm`
therefore binds `timm.data` to its real `constants` module before timm's own `__init__` runs.
No module is faked: every line that runs is timm's.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: never reach a hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TIMM_VERSION = "0.6.13"
TEXT_LENGTH = 32
VOCAB = 1000

Inputs = dict[str, Any]
"""Model input name -> example torch tensor (its shape is the exported static shape)."""


@dataclass(frozen=True)
class Arch:
    name: str
    source: str  # "transformers" | "timm"
    kind: str  # "text encoder", "text decoder", "vision", ...
    build: Callable[[], tuple[Any, Inputs]]
    """A module in eval mode whose forward takes the inputs as keywords and returns one tensor,
    and its example inputs."""


# ---------------------------------------------------------------------------------- imports


def import_timm() -> ModuleType:
    """timm 0.6.13 without its data pipeline (see the module docstring)."""
    if "timm" in sys.modules and hasattr(sys.modules["timm"], "create_model"):
        return sys.modules["timm"]
    spec = importlib.util.find_spec("timm")
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(
            f"timm is not installed: pip install --no-deps timm=={TIMM_VERSION}", name="timm"
        )
    timm = importlib.util.module_from_spec(spec)
    sys.modules["timm"] = timm
    try:
        data_spec = importlib.util.find_spec("timm.data")
        assert data_spec is not None
        data = importlib.util.module_from_spec(data_spec)
        sys.modules["timm.data"] = data
        timm.data = data  # type: ignore[attr-defined]
        constants = importlib.import_module("timm.data.constants")
        data.__dict__.update({k: v for k, v in vars(constants).items() if k.isupper()})
        spec.loader.exec_module(timm)
    except BaseException:
        for name in [n for n in sys.modules if n == "timm" or n.startswith("timm.")]:
            del sys.modules[name]
        raise
    if timm.__version__ != TIMM_VERSION:  # type: ignore[attr-defined]
        raise RuntimeError(
            f"timm {timm.__version__} found, {TIMM_VERSION} needed: later versions import "  # type: ignore[attr-defined]
            f"torchvision (pip install --no-deps timm=={TIMM_VERSION})"
        )
    return timm


# ---------------------------------------------------------------------------------- weights


def revive(module: Any, forward: Callable[[], Any] | None = None, seed: int = 0) -> int:
    """Bring every branch to life; returns how many tensors were changed.

    Near-zero scale parameters (layer scales, zero-initialised gains and BatchNorm weights)
    get a real size. BatchNorm statistics come from the data: `forward` (the model on its
    example inputs) runs once with every BatchNorm in training mode, so each normalises what
    it really sees, and they are then perturbed at random (mean +-0.1 sigma, variance x0.8-1.25)
    with affine parameters drawn at random. Without data (or when a BatchNorm sees a single
    value per channel) the statistics are random around mean 0, variance 1. Statistics that
    ignore the data would let activations grow layer by layer (1e9 at the end of a deep CNN),
    past float16's range.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    changed = 0

    def uniform(shape: Any, low: float, high: float) -> Any:
        return torch.rand(shape, generator=generator) * (high - low) + low

    def normal(shape: Any, std: float) -> Any:
        return torch.randn(shape, generator=generator) * std

    norms: list[Any] = [
        m
        for m in module.modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    ]
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.rsplit(".", 1)[-1] == "bias" or param.numel() == 0:
                continue
            if float(param.abs().max()) < 1e-3:  # a layer scale, a zero-initialised gain
                param.copy_(
                    uniform(param.shape, 0.5, 1.0)
                    if param.dim() <= 1
                    else normal(param.shape, 0.02)
                )
                changed += 1
        for norm in norms:
            if norm.affine:
                norm.weight.copy_(uniform(norm.weight.shape, 0.5, 1.5))
                norm.bias.copy_(normal(norm.bias.shape, 0.1))
            norm.running_mean.zero_()
            norm.running_var.fill_(1.0)
        calibrated = False
        if forward is not None and norms:
            momenta = [norm.momentum for norm in norms]
            for norm in norms:
                norm.reset_running_stats()
                norm.momentum = None  # a cumulative average: one batch gives its statistics
                norm.train()
            try:
                forward()
                calibrated = True
            except (ValueError, RuntimeError):  # one value per channel: no statistics
                pass
            for norm, momentum in zip(norms, momenta, strict=True):
                norm.momentum = momentum
                norm.eval()
        for norm in norms:
            if not calibrated:
                norm.reset_running_stats()
            sigma = norm.running_var.clamp_min(1e-6).sqrt()
            norm.running_mean.add_(normal(sigma.shape, 0.1) * sigma)
            norm.running_var.mul_(uniform(sigma.shape, 0.8, 1.25))
            changed += 1
    return changed


# ---------------------------------------------------------------------------- transformers


def _batch(x: Any, size: int = 4) -> Any:
    """The example (batch 1) and random others: BatchNorm statistics need more than one
    value per channel where the feature map is 1x1."""
    import torch

    others = torch.randn(size - 1, *x.shape[1:], generator=torch.Generator().manual_seed(1))
    return torch.cat([x, others])


def _wrap(model: Any, field: int = 0, **fixed: Any) -> Any:
    """A module whose forward(**inputs) returns one tensor of `model`'s outputs."""
    import torch

    class One(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, **inputs: Any) -> Any:
            return self.model(**inputs, **fixed, return_dict=False)[field]

    return One().eval()


def _text_inputs(seed: int = 0) -> Inputs:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, VOCAB, (1, TEXT_LENGTH), generator=generator),
        "attention_mask": torch.ones(1, TEXT_LENGTH, dtype=torch.int64),
    }


def _hf(
    config_name: str, model_name: str, decoder: bool = False, **config: Any
) -> Callable[[], tuple[Any, Inputs]]:
    def build() -> tuple[Any, Inputs]:
        import torch
        import transformers

        torch.manual_seed(0)
        cfg = getattr(transformers, config_name)(**config)
        cfg._attn_implementation = "eager"
        model = getattr(transformers, model_name)(cfg).eval()
        inputs = _text_inputs()
        revive(model, lambda: model(**inputs))
        extra = {"use_cache": False} if decoder else {}
        return _wrap(model, **extra), inputs

    return build


def _hf_vision(
    config_name: str, model_name: str, size: int, channels: int = 3, **config: Any
) -> Callable[[], tuple[Any, Inputs]]:
    def build() -> tuple[Any, Inputs]:
        import torch
        import transformers

        torch.manual_seed(0)
        cfg = getattr(transformers, config_name)(**config)
        cfg._attn_implementation = "eager"
        model = getattr(transformers, model_name)(cfg).eval()
        x = torch.randn(1, channels, size, size, generator=torch.Generator().manual_seed(0))
        revive(model, lambda: model(pixel_values=_batch(x)))
        return _wrap(model), {"pixel_values": x}

    return build


def _bart() -> tuple[Any, Inputs]:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BartConfig(
        vocab_size=VOCAB,
        d_model=128,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=128,
    )
    cfg._attn_implementation = "eager"
    model = transformers.BartModel(cfg).eval()
    inputs = _text_inputs()
    inputs["decoder_input_ids"] = torch.randint(
        0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1)
    )
    revive(model, lambda: model(**inputs))
    return _wrap(model, use_cache=False), inputs


def _whisper_encoder() -> tuple[Any, Inputs]:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=16,
        d_model=64,
        encoder_layers=2,
        encoder_attention_heads=4,
        decoder_layers=1,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=32,
        max_target_positions=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    cfg._attn_implementation = "eager"
    model = transformers.WhisperModel(cfg).eval().get_encoder()
    features = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(0))
    revive(model, lambda: model(input_features=features))
    return _wrap(model), {"input_features": features}


def _wav2vec2() -> tuple[Any, Inputs]:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Wav2Vec2Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        conv_dim=(32, 32, 32),
        conv_stride=(5, 2, 2),
        conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        vocab_size=32,
    )
    cfg._attn_implementation = "eager"
    model = transformers.Wav2Vec2Model(cfg).eval()
    audio = torch.randn(1, 1600, generator=torch.Generator().manual_seed(0))
    revive(model, lambda: model(input_values=audio))
    return _wrap(model), {"input_values": audio}


_SMALL_TEXT: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=512,
)
_SMALL_DECODER: dict[str, Any] = dict(
    _SMALL_TEXT, num_key_value_heads=2, max_position_embeddings=128
)

TRANSFORMERS: list[Arch] = [
    Arch("bert", "transformers", "text encoder", _hf("BertConfig", "BertModel", **_SMALL_TEXT)),
    Arch(
        "distilbert",
        "transformers",
        "text encoder",
        _hf(
            "DistilBertConfig",
            "DistilBertModel",
            vocab_size=VOCAB,
            dim=128,
            n_layers=2,
            n_heads=4,
            hidden_dim=512,
        ),
    ),
    Arch(
        "albert",
        "transformers",
        "text encoder",
        _hf("AlbertConfig", "AlbertModel", embedding_size=32, **_SMALL_TEXT),
    ),
    Arch(
        "roberta",
        "transformers",
        "text encoder",
        _hf("RobertaConfig", "RobertaModel", **_SMALL_TEXT),
    ),
    Arch(
        "electra",
        "transformers",
        "text encoder",
        _hf("ElectraConfig", "ElectraModel", embedding_size=32, **_SMALL_TEXT),
    ),
    Arch(
        "deberta-v2",
        "transformers",
        "text encoder",
        _hf(
            "DebertaV2Config",
            "DebertaV2Model",
            relative_attention=True,
            position_buckets=16,
            max_relative_positions=32,
            pos_att_type=["p2c", "c2p"],
            **_SMALL_TEXT,
        ),
    ),
    Arch(
        "t5-encoder",
        "transformers",
        "text encoder",
        _hf(
            "T5Config",
            "T5EncoderModel",
            vocab_size=VOCAB,
            d_model=128,
            d_kv=32,
            d_ff=512,
            num_layers=2,
            num_heads=4,
        ),
    ),
    Arch("bart", "transformers", "text encoder-decoder", _bart),
    Arch(
        "gpt2",
        "transformers",
        "text decoder",
        _hf(
            "GPT2Config",
            "GPT2LMHeadModel",
            True,
            vocab_size=VOCAB,
            n_embd=128,
            n_layer=2,
            n_head=4,
            n_positions=128,
            bos_token_id=0,
            eos_token_id=0,
        ),
    ),
    Arch(
        "gpt-neox",
        "transformers",
        "text decoder",
        _hf(
            "GPTNeoXConfig", "GPTNeoXForCausalLM", True, max_position_embeddings=128, **_SMALL_TEXT
        ),
    ),
    Arch(
        "llama",
        "transformers",
        "text decoder",
        _hf("LlamaConfig", "LlamaForCausalLM", True, **_SMALL_DECODER),
    ),
    Arch(
        "qwen2",
        "transformers",
        "text decoder",
        _hf("Qwen2Config", "Qwen2ForCausalLM", True, **_SMALL_DECODER),
    ),
    Arch(
        "mistral",
        "transformers",
        "text decoder",
        _hf("MistralConfig", "MistralForCausalLM", True, **_SMALL_DECODER),
    ),
    Arch(
        "phi",
        "transformers",
        "text decoder",
        _hf("PhiConfig", "PhiForCausalLM", True, **_SMALL_DECODER),
    ),
    Arch(
        "opt",
        "transformers",
        "text decoder",
        _hf(
            "OPTConfig",
            "OPTForCausalLM",
            True,
            vocab_size=VOCAB,
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=512,
            max_position_embeddings=128,
            word_embed_proj_dim=128,
        ),
    ),
    Arch("whisper-encoder", "transformers", "audio encoder", _whisper_encoder),
    Arch("wav2vec2", "transformers", "audio encoder", _wav2vec2),
    Arch(
        "vit",
        "transformers",
        "vision",
        _hf_vision(
            "ViTConfig",
            "ViTModel",
            64,
            image_size=64,
            patch_size=8,
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=512,
        ),
    ),
    Arch(
        "clip-vision",
        "transformers",
        "vision",
        _hf_vision(
            "CLIPVisionConfig",
            "CLIPVisionModel",
            64,
            image_size=64,
            patch_size=8,
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=512,
        ),
    ),
    Arch(
        "swin",
        "transformers",
        "vision",
        _hf_vision(
            "SwinConfig",
            "SwinModel",
            64,
            image_size=64,
            patch_size=4,
            embed_dim=48,
            depths=[2, 2, 2],
            num_heads=[2, 4, 8],
            window_size=4,
        ),
    ),
    Arch(
        "convnext",
        "transformers",
        "vision",
        _hf_vision(
            "ConvNextConfig",
            "ConvNextModel",
            64,
            hidden_sizes=[32, 64, 96, 128],
            depths=[1, 1, 2, 1],
        ),
    ),
    Arch(
        "resnet",
        "transformers",
        "vision",
        _hf_vision(
            "ResNetConfig",
            "ResNetModel",
            64,
            embedding_size=32,
            hidden_sizes=[32, 64, 96, 128],
            depths=[1, 1, 1, 1],
            layer_type="bottleneck",
        ),
    ),
    Arch(
        "segformer",
        "transformers",
        "vision",
        _hf_vision(
            "SegformerConfig",
            "SegformerModel",
            64,
            hidden_sizes=[16, 32, 64, 96],
            num_attention_heads=[1, 2, 4, 4],
            depths=[1, 1, 1, 1],
            decoder_hidden_size=64,
        ),
    ),
    Arch(
        "mobilevit",
        "transformers",
        "vision",
        _hf_vision(
            "MobileViTConfig",
            "MobileViTModel",
            64,
            image_size=64,
            hidden_sizes=[32, 48, 64],
            neck_hidden_sizes=[8, 16, 24, 32, 48, 64, 160],
        ),
    ),
]

# -------------------------------------------------------------------------------------- timm


def _timm(model: str, size: int, **kwargs: Any) -> Callable[[], tuple[Any, Inputs]]:
    """A registered timm model (`kwargs` override its defaults), or with `model` "module.Class"
    a timm class built from `kwargs` alone."""

    def build() -> tuple[Any, Inputs]:
        import torch

        timm = import_timm()
        torch.manual_seed(0)
        if "." in model:
            module, cls = model.rsplit(".", 1)
            net = getattr(importlib.import_module(f"timm.models.{module}"), cls)(**kwargs)
        else:
            net = timm.create_model(model, pretrained=False, **kwargs)
        net.eval()
        x = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(0))
        revive(net, lambda: net(_batch(x)))

        class Images(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.net = net

            def forward(self, pixel_values: Any) -> Any:
                return self.net(pixel_values)

        return Images().eval(), {"pixel_values": x}

    return build


TIMM: list[Arch] = [
    Arch("timm-resnet18", "timm", "vision", _timm("resnet18", 64)),
    Arch("timm-convnext-atto", "timm", "vision", _timm("convnext_atto", 64)),
    Arch(
        "timm-swin",
        "timm",
        "vision",
        _timm(
            "swin_transformer.SwinTransformer",
            112,
            img_size=112,
            window_size=7,
            embed_dim=48,
            depths=(2, 2, 2),
            num_heads=(2, 4, 8),
        ),
    ),
    Arch("timm-efficientnet-b0", "timm", "vision", _timm("efficientnet_b0", 64)),
    Arch("timm-mobilenetv3", "timm", "vision", _timm("mobilenetv3_small_100", 64)),
    Arch("timm-regnetx-002", "timm", "vision", _timm("regnetx_002", 64)),
    Arch("timm-densenet121", "timm", "vision", _timm("densenet121", 64)),
    Arch("timm-inception-v3", "timm", "vision", _timm("inception_v3", 75)),
    Arch("timm-hrnet-w18-small", "timm", "vision", _timm("hrnet_w18_small", 64)),
    Arch("timm-repvgg-a2", "timm", "vision", _timm("repvgg_a2", 64)),
    Arch("timm-vit-tiny", "timm", "vision", _timm("vit_tiny_patch16_224", 64, img_size=64)),
    Arch("timm-deit-tiny", "timm", "vision", _timm("deit_tiny_patch16_224", 64, img_size=64)),
    Arch("timm-mixer", "timm", "vision", _timm("mixer_s16_224", 64, img_size=64)),
    Arch("timm-maxvit-pico", "timm", "vision", _timm("maxvit_rmlp_pico_rw_256", 128, img_size=128)),
    Arch("timm-mobilevit-xxs", "timm", "vision", _timm("mobilevit_xxs", 64)),
    Arch("timm-poolformer-s12", "timm", "vision", _timm("poolformer_s12", 64)),
    Arch("timm-levit-128s", "timm", "vision", _timm("levit_128s", 64, img_size=64)),
    Arch("timm-ghostnet", "timm", "vision", _timm("ghostnet_050", 64)),
    Arch("timm-edgenext", "timm", "vision", _timm("edgenext_xx_small", 64)),
]

ALL: list[Arch] = TRANSFORMERS + TIMM
