"""The models ``spmd zoo`` trains: real models built from their libraries' configs (no weights, no network).

``ZOO`` is the one table: per model the libraries it needs, its batch and sequence (or image side),
a toy size for the CPU and the tests (dropout off, so that every mode computes the same losses), its
fully_shard unit and its optimizer. At full size the configs keep their libraries' defaults (BERT, T5 and
GPT-2 train with dropout 0.1: their modes' first losses differ by dropout's random draws). A model's builder
returns the model wrapped so that ``model(x, y)`` returns the training loss, and a function that
draws one batch ``(x, y)`` from a generator; the wrapper is what every mode trains, so eager,
``torch.compile`` and ``spmd.compile`` see the same module.

The libraries (transformers, peft, timm, torchvision, diffusers) are no dependency of spmd:
``pip install 'spmd[bench]'`` brings them, and each is imported only when a model that needs it is
built (``require`` names the missing package and the install command).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

Batch = Callable[[torch.Generator], tuple]  # generator -> (x, y) on the CPU
Builder = Callable[[bool, int, int], tuple[nn.Module, Batch]]  # (toy, batch, seq) -> (model, batch drawer)


def require(*packages: str) -> list:
    """The imported ``packages``; an ImportError naming the first one missing and how to install it."""
    modules = []
    for name in packages:
        try:
            modules.append(importlib.import_module(name))
        except Exception as err:  # noqa: BLE001 - a broken install (timm without its torchvision) counts too
            first = (str(err).strip().splitlines() or [""])[0]
            raise ImportError(f"needs {name} ({type(err).__name__}: {first}): pip install 'spmd[bench]' "
                              f"(or pip install {name})") from err
    return modules


@dataclass(frozen=True)
class ZooModel:
    """One row of the zoo: how to build the model and how big a step is."""

    build: Builder
    packages: tuple[str, ...]
    what: str  # the model as the table names it
    batch: int
    seq: int  # tokens per sample, or the image side in pixels
    toy_batch: int
    toy_seq: int
    unit: str  # class name of the fully_shard unit (the repeated block)
    per: str = "tokens"  # what ``batch * seq`` (tokens) or ``batch`` (images) counts per step
    optimizer: str = "adamw"  # or "sgd": SGD momentum 0.9
    channels_last: bool = False

    def missing(self) -> Optional[str]:
        """Why this model cannot be built here (a library does not import), or None."""
        try:
            require(*self.packages)
        except ImportError as err:
            return str(err)
        return None

    def items_per_step(self, batch: int, seq: int) -> int:
        return batch * seq if self.per == "tokens" else batch


class LossOf(nn.Module):
    """``model(x, y)`` -> the loss: a Hugging Face model called with ``input_ids`` and ``labels``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        return self.model(input_ids=x, labels=y).loss


class Classifier(nn.Module):
    """``model(x, y)`` -> cross-entropy of an image classifier's logits against the labels ``y``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        return F.cross_entropy(self.model(x), y)


class Denoiser(nn.Module):
    """``model(x, y)`` -> the MSE of a text-conditioned UNet's noise prediction for noisy latents ``x`` against the
    noise ``y``, at fixed timesteps and text embeddings (buffers: the same in every step and mode)."""

    def __init__(self, unet: nn.Module, batch: int, text_len: int, gen: torch.Generator):
        super().__init__()
        self.unet = unet
        # on the CPU, where the generator is (the caller moves the model to its device)
        self.register_buffer("timesteps", torch.randint(0, 1000, (batch,), generator=gen, device="cpu"),
                             persistent=False)
        text = torch.randn(batch, text_len, unet.config.cross_attention_dim, generator=gen, device="cpu")
        self.register_buffer("text", text, persistent=False)

    def forward(self, x, y):
        return F.mse_loss(self.unet(x, self.timesteps, encoder_hidden_states=self.text).sample, y)


def _tokens(vocab: int, batch: int, seq: int) -> Batch:
    return lambda gen: (torch.randint(0, vocab, (batch, seq), generator=gen),
                        torch.randint(0, vocab, (batch, seq), generator=gen))


def _images(classes: int, batch: int, side: int) -> Batch:
    return lambda gen: (torch.randn(batch, 3, side, side, generator=gen),
                        torch.randint(0, classes, (batch,), generator=gen))


def _hf(config_name: str, full: dict, toy: dict, lora: bool = False) -> Builder:
    """A transformers model with a loss head, ``"ConfigClass:ModelClass"`` built from ``full`` or ``toy``'s config
    values; ``lora``: peft LoRA r=16 on q/k/v/o with the base frozen."""
    def build(is_toy: bool, batch: int, seq: int):
        (transformers,) = require("transformers")
        config_class, model_class = config_name.split(":")
        config = getattr(transformers, config_class)(**(toy if is_toy else full))
        model = getattr(transformers, model_class)(config)
        if lora:
            (peft,) = require("peft")
            model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        return LossOf(model), _tokens(config.vocab_size, batch, seq)
    return build


_LLAMA = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
              intermediate_size=2816, vocab_size=32000, max_position_embeddings=1024)
_TOY_DECODER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=64, vocab_size=128, max_position_embeddings=64)


def _vit(is_toy: bool, batch: int, side: int):
    (timm,) = require("timm")
    if is_toy:
        model = timm.models.VisionTransformer(img_size=side, patch_size=8, embed_dim=32, depth=2, num_heads=2,
                                              num_classes=10)
    else:
        model = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=1000)
    return Classifier(model), _images(model.num_classes, batch, side)


def _resnet50(is_toy: bool, batch: int, side: int):
    (torchvision,) = require("torchvision")
    resnet = torchvision.models.resnet
    model = resnet.ResNet(resnet.Bottleneck, [1, 1, 1, 1], num_classes=10) if is_toy else resnet.resnet50()
    return Classifier(model), _images(model.fc.out_features, batch, side)


def _unet(is_toy: bool, batch: int, side: int):
    (diffusers,) = require("diffusers")
    if is_toy:
        config = dict(sample_size=side, block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4,
                      cross_attention_dim=16, attention_head_dim=2,
                      down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                      up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    else:  # Stable Diffusion 1.x's UNet: 64x64 latents of 512px images, CLIP text embeddings of 77 tokens
        config = dict(sample_size=side, cross_attention_dim=768, attention_head_dim=8)
    unet = diffusers.UNet2DConditionModel(**config)
    model = Denoiser(unet, batch, 8 if is_toy else 77, torch.Generator().manual_seed(1))
    channels = unet.config.in_channels
    return model, lambda gen: (torch.randn(batch, channels, side, side, generator=gen),
                               torch.randn(batch, channels, side, side, generator=gen))


ZOO: dict[str, ZooModel] = {
    "llama": ZooModel(_hf("LlamaConfig:LlamaForCausalLM", _LLAMA, _TOY_DECODER), ("transformers",),
                      "Llama 1024d 8L GQA 16/4 SwiGLU 2816, vocab 32000", 8, 1024, 2, 16, "LlamaDecoderLayer"),
    "llama_lora": ZooModel(_hf("LlamaConfig:LlamaForCausalLM", _LLAMA, _TOY_DECODER, lora=True),
                           ("transformers", "peft"), "Llama above + LoRA r=16 q/k/v/o, base frozen", 8, 1024, 2, 16,
                           "LlamaDecoderLayer"),
    "qwen2": ZooModel(_hf("Qwen2Config:Qwen2ForCausalLM",
                                 dict(hidden_size=896, num_hidden_layers=8, num_attention_heads=14, num_key_value_heads=2,
                                      intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                                      max_position_embeddings=1024),
                                 dict(_TOY_DECODER, tie_word_embeddings=True)),
                      ("transformers",), "Qwen2 896d 8L 14/2 heads, vocab 151936 tied", 8, 1024, 2, 16,
                      "Qwen2DecoderLayer"),
    "mixtral": ZooModel(_hf("MixtralConfig:MixtralForCausalLM",
                                   dict(_LLAMA, num_local_experts=8, num_experts_per_tok=2),
                                   dict(_TOY_DECODER, num_local_experts=4, num_experts_per_tok=2)),
                        ("transformers",), "Mixtral-style MoE 1024d 8L, 8 experts top-2", 8, 1024, 2, 16,
                        "MixtralDecoderLayer"),
    "bert": ZooModel(_hf("BertConfig:BertForMaskedLM", dict(max_position_embeddings=512),
                                dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                     vocab_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)),
                     ("transformers",), "BERT-base MLM (every position predicted)", 32, 512, 2, 16, "BertLayer"),
    "t5": ZooModel(_hf("T5Config:T5ForConditionalGeneration",
                              dict(d_model=512, d_ff=2048, d_kv=64, num_layers=6, num_decoder_layers=6, num_heads=8,
                                   vocab_size=32128, decoder_start_token_id=0, pad_token_id=0),
                              dict(d_model=32, d_ff=64, d_kv=8, num_layers=2, num_decoder_layers=2, num_heads=4,
                                   vocab_size=128, decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)),
                   ("transformers",), "T5 512d 6+6 layers (encoder and decoder seq)", 32, 512, 2, 16, "T5Block"),
    "gpt2": ZooModel(_hf("GPT2Config:GPT2LMHeadModel", dict(n_positions=1024),
                                dict(n_embd=32, n_layer=2, n_head=2, vocab_size=128, n_positions=64, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)),
                     ("transformers",), "GPT-2 124M", 8, 1024, 2, 16, "GPT2Block"),
    "vit": ZooModel(_vit, ("timm",), "timm ViT-B/16 224px", 64, 224, 2, 32, "Block", per="images"),
    "resnet50": ZooModel(_resnet50, ("torchvision",), "torchvision ResNet-50 224px, channels_last, SGD momentum",
                         64, 224, 2, 32, "Bottleneck", per="images", optimizer="sgd", channels_last=True),
    "unet": ZooModel(_unet, ("diffusers",), "diffusers UNet2DCondition (SD 1.x shape), 64x64 latents", 8, 64, 2, 16,
                     "BasicTransformerBlock", per="images"),
}


def unit_classes(model: nn.Module, unit: str) -> set[type]:
    """The classes named ``unit`` among ``model``'s modules: the fully_shard wrap policy."""
    found = {type(m) for m in model.modules() if type(m).__name__ == unit}
    if not found:
        raise ValueError(f"spmd zoo: no module of class {unit} in {type(model).__name__}; the zoo table's unit "
                         "must name the model's repeated block")
    return found
