"""`qshard generate`: talk to a trained model in one process (one GPU or the CPU), its base quantized as in
training. From a run (`--run`, a checkpoint of it) or from any PEFT LoRA/DoRA adapter of a base (`--model
--adapter`); one completion (`--prompt`) or a conversation (`--chat`). Completions go to standard output,
everything else to standard error."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

from qshard import checkpoint
from qshard import config as config_mod
from qshard.build import build_model, load_tokenizer, resolve_model, training_tokenizer
from qshard.checkpoint import base_fingerprint_all_ranks
from qshard.errors import QShardError
from qshard.export import DORA_MAGNITUDE, PEFT_PREFIX
from qshard.export_cmd import find_checkpoint, reading_config
from qshard.export_tokenizer import GENERATION_CONFIG, export_tokenizer, plain_text_run
from qshard.hf_config import read_json_object
from qshard.parallel.distributed import DistEnv, init_distributed, shutdown

log = logging.getLogger("qshard")

EXIT_COMMAND = "/exit"


@dataclass
class Sampling:
    """How tokens are chosen: greedy at temperature 0, else sampled (with nucleus `top_p`) from `seed`."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int = 0

    def check(self) -> None:
        if self.temperature < 0:
            raise QShardError(f"--temperature must be >= 0 (0: greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise QShardError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise QShardError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")

    def generation_config(self, ends: list[int], pad: int | None) -> GenerationConfig:
        greedy = self.temperature == 0
        return GenerationConfig(max_new_tokens=self.max_new_tokens, do_sample=not greedy,
                                temperature=None if greedy else self.temperature,
                                top_p=None if greedy else self.top_p, top_k=None if greedy else 0,  # 0: no top-k
                                eos_token_id=ends or None, pad_token_id=pad)


@dataclass
class Chatbot:
    """A loaded model with what generation needs: the tokenizer, the chat template training used (None: a plain
    text model, prompts are raw text) and the ids that end an answer."""

    model: nn.Module
    tokenizer: Any
    template: str | None
    ends: list[int]
    device: torch.device

    def encode(self, messages: list[dict[str, str]]) -> torch.Tensor:
        if self.template is None:
            ids = self.tokenizer(messages[-1]["content"], return_tensors="pt")["input_ids"]
        else:
            ids = self.tokenizer.apply_chat_template(messages, chat_template=self.template, add_generation_prompt=True,
                                                     return_tensors="pt", return_dict=True)["input_ids"]
        return ids.to(self.device)

    @torch.no_grad()
    def reply(self, messages: list[dict[str, str]], sampling: Sampling) -> str:
        """Generate the answer to `messages`, streamed to standard output as it comes; returns its text."""
        ids = self.encode(messages)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else (self.ends or [None])[0]
        config = sampling.generation_config(self.ends, pad)
        # Rows of the embedding past the tokenizer's (padded vocabularies) decode to no text: never chosen.
        config.suppress_tokens = list(range(len(self.tokenizer), self.model.config.vocab_size)) or None
        end = self.turn_end_text()
        if end:  # a template whose turn ends in text, not a token, ends the answer there
            config.stop_strings = [end]
        torch.manual_seed(sampling.seed)  # the same seed, the same completion (CPU and CUDA generators)
        printer = AnswerPrinter(self.tokenizer, end)
        self.model.generate(ids, attention_mask=torch.ones_like(ids), streamer=printer, generation_config=config,
                            tokenizer=self.tokenizer)
        return printer.answer

    def turn_end_text(self) -> str:
        """What the template writes after an answer's content, when that is text rather than a special token (e.g.
        chatml's `<|im_end|>` in a vocabulary without that token): the model generates it as text."""
        if self.template is None:
            return ""
        probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\x00"}]
        text = self.tokenizer.apply_chat_template(probe, chat_template=self.template, tokenize=False)
        end = text.rsplit("\x00", 1)[-1].strip() if "\x00" in text else ""
        ids = self.tokenizer.encode(end, add_special_tokens=False)
        return end if self.tokenizer.decode(ids, skip_special_tokens=True).strip() == end else ""  # a token's: ""


class AnswerPrinter(BaseStreamer):
    """Prints an answer to standard output as its tokens come, a whole word at a time (a token may be part of one),
    without the special tokens or the text that ends the turn (`end`); `answer` is what it printed."""

    def __init__(self, tokenizer, end: str) -> None:
        self.tokenizer, self.stop = tokenizer, end
        self.tokens: list[int] = []
        self.prompt_seen = False
        self.answer = ""

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate hands the streamer the prompt first
            self.prompt_seen = True
            return
        self.tokens.extend(value.reshape(-1).tolist())
        text = self._text()
        # Held back: the last word (a later token may extend or respace it) and what could begin the end text.
        stable = text[: max(text.rfind(" "), text.rfind("\n")) + 1]
        if self.stop:
            stable = stable[: max(len(text) - len(self.stop), 0)]
        if stable.startswith(self.answer):
            self._print(stable)

    def end(self) -> None:
        text = self._text()
        if self.stop and self.stop in text:
            text = text[: text.index(self.stop)]
        self._print(text.rstrip())
        print(flush=True)

    def _text(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def _print(self, text: str) -> None:
        print(text[len(self.answer):], end="", flush=True)
        self.answer = text


def run_generate(run_dir: str | None, ckpt_arg: str | None, model_arg: str | None, adapter_arg: str | None,
                 overrides: list[tuple[str, str]], prompt: str | None, chat: bool, sampling: Sampling) -> None:
    """Check the options, load the model (from a run, or a base and an adapter) and answer `prompt`, or lines of
    standard input as a conversation when `chat`."""
    sampling.check()
    if (prompt is None) == (not chat):
        raise QShardError("give one of --prompt TEXT or --chat")
    if (run_dir is None) == (model_arg is None):
        raise QShardError("give one of --run DIR or --model DIR --adapter DIR")
    if model_arg is not None and adapter_arg is None:
        raise QShardError("--model: give the adapter to load with --adapter DIR")
    if model_arg is not None and ckpt_arg is not None:
        raise QShardError("--checkpoint: only with --run; with --model, --adapter names the weights")
    if run_dir is not None and (adapter_arg or overrides):
        what = "--adapter" if adapter_arg else f"--{overrides[0][0]}"
        raise QShardError(f"{what}: only with --model; a run's checkpoint is loaded as the run was trained")
    env = init_distributed()
    try:
        if env.world_size > 1:
            raise QShardError("qshard generate runs in one process (one GPU or the CPU), not under a launcher")
        if run_dir:
            bot = _from_run(Path(run_dir), ckpt_arg, env, chat)
        else:
            bot = _from_adapter(model_arg, Path(adapter_arg), overrides, env, chat)
        bot.model.eval()
        if chat:
            _chat(bot, sampling)
        else:
            bot.reply([{"role": "user", "content": prompt}], sampling)
    finally:
        shutdown()


def _chat(bot: Chatbot, sampling: Sampling) -> None:
    """A conversation: each line of standard input a user turn, answered with the whole history, until end of
    input or /exit. Prompts and notes go to standard error, so standard output holds the answers only."""
    history: list[dict[str, str]] = []
    print(f"chat: one line per turn; {EXIT_COMMAND} or end of input to stop", file=sys.stderr)
    while True:
        print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == EXIT_COMMAND:
            break
        if not line.strip():
            continue
        history.append({"role": "user", "content": line.rstrip("\n")})
        history.append({"role": "assistant", "content": bot.reply(history, sampling)})


def _one_process_config(cfg: config_mod.Config) -> None:
    """Whatever the run was trained with, one process generates: no sharding across replicas, no offload, no
    compile (every step of generation has another shape)."""
    reading_config(cfg)
    cfg.parallel.nproc, cfg.parallel.activation_offload = 1, False


def _no_template(option: str) -> QShardError:
    return QShardError(f"--chat: {option} has no chat template (it was trained on plain text); use --prompt")


def _from_run(run_dir: Path, ckpt_arg: str | None, env: DistEnv, chat: bool) -> Chatbot:
    """The run's model as export_cmd rebuilds it (its base at the commit trained from, its checkpoint), with the
    tokenizer and chat template training used. `chat`: refuse a plain-text run before anything is loaded."""
    if not run_dir.is_dir():
        raise QShardError(f"--run: {run_dir} is not a directory")
    ckpt = find_checkpoint(run_dir, ckpt_arg)
    state = checkpoint.read_state(ckpt)
    cfg = config_mod.resolve(str(ckpt / "config.yaml"), [])
    if chat and plain_text_run(cfg.data):
        raise _no_template(f"the run {run_dir}")
    _one_process_config(cfg)
    model_dir, _ = resolve_model(cfg, env, state.get("base_commit"))
    checkpoint.follow_saved_autos(cfg, state)
    checkpoint.check_compatible(ckpt, state, cfg, base_fingerprint_all_ranks(cfg, env, model_dir))
    tokenizer = export_tokenizer(cfg, training_tokenizer(cfg, model_dir), model_dir)
    model, _ = build_model(cfg, env, model_dir, state.get("vocab_size"))
    checkpoint.load(ckpt, model, optimizer=None)
    log.info("generating with %s (%s)", ckpt, cfg.train.train_type)
    template = None if plain_text_run(cfg.data) else tokenizer.chat_template
    return Chatbot(model, tokenizer.tokenizer, template, tokenizer.generation.get("eos_token_id", []), env.device)


# adapter_config.json keys that ask for what qshard's adapters cannot represent, by the value that means "not used"
# (None, or an empty list or dict, means it too). Layer subsets need none: a layer the adapter lacks keeps B = 0.
_UNSUPPORTED = {"rank_pattern": {}, "alpha_pattern": {}, "fan_in_fan_out": False, "bias": "none", "use_qalora": False,
                "lora_bias": False, "layer_replication": None, "trainable_token_indices": None,
                "target_parameters": None, "alora_invocation_tokens": None, "use_bdlora": None}


def read_adapter_config(adapter: Path) -> dict[str, Any]:
    """adapter_config.json of a PEFT LoRA (or DoRA) adapter, refused with one line for anything else."""
    path = adapter / "adapter_config.json"
    config = read_json_object(path, "--adapter")
    if config.get("peft_type") != "LORA":
        raise QShardError(f"{path}: peft_type {config.get('peft_type')!r}; qshard generate loads LORA adapters only")
    for key, unused in _UNSUPPORTED.items():
        value = config.get(key)
        if value not in (None, unused) and value not in ([], {}):
            raise QShardError(f"{path}: {key}={config[key]!r} is not supported by qshard's adapters")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or isinstance(config.get(key), bool) or config[key] <= 0:
            raise QShardError(f"{path}: {key} must be a positive number, got {config.get(key)!r}")
    return config


def read_adapter_tensors(adapter: Path) -> dict[str, torch.Tensor]:
    path = adapter / "adapter_model.safetensors"
    try:
        return load_file(path)
    except (OSError, SafetensorError) as exc:
        raise QShardError(f"--adapter: cannot read {path} ({exc})") from None


def adapter_params(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors under qshard's parameter names (the inverse of export.gather_lora's naming): LoRA's
    A and B, DoRA's magnitude, and the modules trained in full (PEFT's `modules_to_save.` part dropped)."""
    params = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(PEFT_PREFIX).replace(".modules_to_save.", ".").replace(".default.", ".")
        for peft_name, ours in ((".lora_A.weight", ".lora_A"), (".lora_B.weight", ".lora_B"),
                                (f".{DORA_MAGNITUDE}.weight", ".magnitude"), (f".{DORA_MAGNITUDE}", ".magnitude")):
            if name.endswith(peft_name):
                name = name[: -len(peft_name)] + ours
                break
        params[name] = tensor
    return params


def adapter_train_config(model_arg: str, config: dict[str, Any], params: dict[str, torch.Tensor],
                         overrides: list[tuple[str, str]]) -> config_mod.Config:
    """The qlora (qdora) configuration that builds `model_arg` with adapters of this rank and scaling on the
    linears the adapter targets (by leaf name, from its tensors), and its trained-in-full modules; `overrides`
    (--section.key VALUE) after, e.g. another quant.method or train.precision."""
    dora = bool(config.get("use_dora"))
    leaves = sorted({n.rsplit(".", 2)[-2] for n in params if n.endswith(".lora_A")})
    saved = config.get("modules_to_save") or []
    pairs = [("model.path", model_arg), ("train.train_type", "qdora" if dora else "qlora"),
             ("lora.rank", str(int(config["r"]))), ("lora.alpha", str(config["lora_alpha"])),
             ("lora.use_rslora", "true" if config.get("use_rslora") else "false"),
             ("lora.target_modules", json.dumps(leaves))]
    if saved:
        pairs.append(("lora.modules_to_save", json.dumps(sorted({s.rsplit(".", 1)[-1] for s in saved}))))
    return config_mod.resolve(None, pairs + overrides)


def _from_adapter(model_arg: str, adapter: Path, overrides: list[tuple[str, str]], env: DistEnv,
                  chat: bool) -> Chatbot:
    """A base with a PEFT adapter: built as a qlora (qdora) run of it would be, its adapters set from the
    adapter's tensors; the adapter's tokenizer and generation config where it has them, else the base's."""
    if not adapter.is_dir():
        raise QShardError(f"--adapter: {adapter} is not a directory")
    config = read_adapter_config(adapter)
    params = adapter_params(read_adapter_tensors(adapter))
    if not any(n.endswith(".lora_A") for n in params):
        raise QShardError(f"--adapter: {adapter / 'adapter_model.safetensors'} holds no LoRA tensors")
    cfg = adapter_train_config(model_arg, config, params, overrides)
    _one_process_config(cfg)
    model_dir, _ = resolve_model(cfg, env)
    tokenizer = _adapter_tokenizer(adapter, cfg, model_dir)
    template = getattr(tokenizer, "chat_template", None)
    if chat and template is None:
        raise _no_template(f"the tokenizer of {adapter} (or of its base)")
    model, _ = build_model(cfg, env, model_dir, len(tokenizer))
    set_adapter(model, params, adapter)
    log.info("generating with %s on %s (%s)", adapter, model_arg, cfg.train.train_type)
    ends = _end_ids(adapter, model_dir, tokenizer)
    return Chatbot(model, tokenizer, template, ends, env.device)


def _adapter_tokenizer(adapter: Path, cfg: config_mod.Config, model_dir: Path | None):
    """The adapter's own tokenizer (qshard's exports carry the one training used, template included), else the
    base's. Tokens the adapter's has beyond the base's (data.add_special_tokens of the run that trained it) become
    cfg.data.add_special_tokens, so that the model is built with their rows, as training built it."""
    if not (adapter / "tokenizer_config.json").is_file():
        return training_tokenizer(cfg, model_dir)
    tokenizer = load_tokenizer(adapter)
    base = training_tokenizer(cfg, model_dir).get_vocab()
    cfg.data.add_special_tokens = [t for t, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
                                   if t not in base] or None
    return tokenizer


def _end_ids(adapter: Path, model_dir: Path | None, tokenizer) -> list[int]:
    """eos_token_id of the adapter's generation config, else of the base's, else the tokenizer's eos."""
    for place in (adapter, model_dir):
        path = None if place is None else Path(place) / GENERATION_CONFIG
        if path is not None and path.is_file():
            try:
                ends = json.loads(path.read_text()).get("eos_token_id")
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
                raise QShardError(f"{path}: cannot read it ({exc})") from None
            if ends is not None:
                return [ends] if isinstance(ends, int) else list(ends)
    return [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]


def set_adapter(model: nn.Module, params: dict[str, torch.Tensor], adapter: Path) -> None:
    """Copy the adapter's tensors into the model's adapters and trained modules, each checked against the
    parameter it replaces (another base's adapter has other shapes, or names the model lacks)."""
    own = dict(model.named_parameters(remove_duplicate=False))
    where = adapter / "adapter_model.safetensors"
    for name, tensor in params.items():
        if name not in own:
            raise QShardError(f"{where}: {name} has no place in the model built from the base (an adapter of "
                              "another model, or of modules qshard does not adapt)")
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise QShardError(f"{where}: {name} has shape {tuple(tensor.shape)}, the base's needs "
                              f"{tuple(own[name].shape)}: an adapter of another model?")
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, {n: t.to(own[n].dtype) for n, t in params.items()}, options=options)
