"""meshformer's model as an lm-evaluation-harness language model: loglikelihood, rolling loglikelihood, generation.

Requests are tokenized, truncated, batched and scored as lm-eval's own `hf` model does (the same tokenizer calls
through transformers' tokenizer of the checkpoint's files, the same left truncation to the model's positions, right
padding for scoring, the continuation's log-probabilities summed in fp32), so a model imported from a Hugging Face
directory scores what `hf` scores there. Generation runs models/generate.py's KV-cache loop over a left-padded
batch and stops a row at the end-of-text token or once its text holds a stop sequence.

Under several processes (`group`: the ranks that split the documents) lm-eval hands each rank its share and gathers
the results through `all_gather` / `gather_object` / `barrier` over that group. When the model itself is sharded
(FSDP: every forward all-gathers parameters, a collective), every rank must run as many forwards as the others:
each rank runs as many scoring batches as the busiest one (the extra ones on a one-token row, their answers
dropped), and a generation batch runs until the rows of every rank are done (a rank already done runs one-token
forwards alongside). lm-eval is imported by whoever imports this module, never at meshformer's import time.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.models import utils as lm_utils
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from meshformer.errors import UserError
from meshformer.models.generate import batch_steps

MAX_GEN_TOKS = 256  # lm-eval's default for a task that names no max_gen_toks (its `hf` model's)


def hf_tokenizer(directory: str | Path):
    """transformers' tokenizer of a directory holding tokenizer.json (+ tokenizer_config.json: special tokens,
    chat template); without a config its end-of-text token is the one meshformer's tokenizer loader finds."""
    import transformers

    from meshformer.data.tokenizer import load_tokenizer, special_token_ids

    directory = Path(directory)
    if (directory / "tokenizer_config.json").is_file():
        return transformers.AutoTokenizer.from_pretrained(str(directory))
    raw = load_tokenizer(directory / "tokenizer.json")
    ids = special_token_ids(raw, directory / "tokenizer.json")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=raw)
    tok.eos_token, tok.bos_token = raw.id_to_token(ids["eos"]), raw.id_to_token(ids["bos"])
    return tok


class MeshformerLM(TemplateLM):
    """`model`: a causal LM (token ids [batch, seq] -> logits [batch, seq, vocab], `new_kv_cache` for generation);
    `tokenizer`: transformers' tokenizer of its files; `max_length`: the positions it was made for; `group`: the
    process group whose ranks split the documents (None: this process runs them all)."""

    def __init__(
        self,
        model,
        tokenizer,
        max_length: int,
        batch_size: int = 1,
        autocast_dtype: torch.dtype | None = None,
        group=None,
    ):
        super().__init__()
        self.model, self.tokenizer, self._max_length = model, tokenizer, max_length
        self.batch_size, self.autocast_dtype = batch_size, autocast_dtype
        self._device = next(model.parameters()).device
        self._group = group
        if group is not None:
            self._rank, self._world_size = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)

    # -- what lm-eval asks of a language model ------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and lm_utils.has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special = {"add_special_tokens": False}  # the text already starts with BOS
        return self.tokenizer.encode(string, **special)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    # -- scoring ---------------------------------------------------------------------------------------------------
    def _logprobs(self, rows: list[list[int]]) -> torch.Tensor:
        """fp32 log-probabilities [rows, longest, vocab] of right-padded rows (causal: padding changes nothing
        before it)."""
        longest = max(len(r) for r in rows)
        batch = torch.tensor([r + [0] * (longest - len(r)) for r in rows], device=self._device)
        with torch.no_grad(), self._autocast():
            logits = self.model(batch)
        return F.log_softmax(logits.float(), dim=-1)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self._device.type, dtype=self.autocast_dtype)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether it is the greedy continuation) per request,
        the context left-truncated so context + continuation fit max_length + 1 tokens."""
        order = lm_utils.Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        res = []
        chunks = list(order.get_batched(n=self.batch_size))
        for _ in range(self._pad_to_busiest_rank(len(chunks))):
            self._idle_forward()
        for chunk in chunks:
            rows = [(ctx + cont)[-(self.max_length + 1) :][:-1] for _, ctx, cont in chunk]
            logprobs = self._logprobs(rows)
            for (request, _, cont), row, lp in zip(chunk, rows, logprobs):
                scored = lp[len(row) - len(cont) : len(row)]
                want = torch.tensor(cont, device=self._device)
                answer = (float(scored.gather(1, want[:, None]).sum()), bool((scored.argmax(-1) == want).all()))
                res.append(answer)
                if request is not None:  # rolling windows are cached per document, by the caller
                    self.cache_hook.add_partial("loglikelihood", request, answer)
        return order.get_original(res)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's whole log-likelihood over disjoint windows of max_length tokens (lm-eval's windows)."""
        windows, counts = [], []
        for (string,) in [req.args for req in requests]:
            parts = get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            mine = [(None, *make_disjoint_window(w)) for w in parts]
            windows += mine
            counts.append(len(mine))
        scores = self._loglikelihood_tokens(windows)
        out, at = [], 0
        for req, n in zip(requests, counts):
            out.append(sum(score for score, _ in scores[at : at + n]))
            at += n
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, out[-1])
        return out

    def _pad_to_busiest_rank(self, n: int) -> int:
        """How many batches this rank runs fewer than the busiest rank (0 in one process)."""
        if self.world_size <= 1:
            return 0
        counts = self.all_gather(torch.tensor(n, device=self._device)).tolist()
        return max(counts) - n

    def _idle_forward(self) -> None:
        """A forward on one token whose result is dropped: the collectives a sharded model's forward runs, for a
        rank with nothing left to score while others still have."""
        with torch.no_grad(), self._autocast():
            self.model(torch.zeros(1, 1, dtype=torch.long, device=self._device))

    def _any_rank_running(self, running: bool) -> bool:
        """Whether this rank or any other still has rows to generate (a collective over the group)."""
        if self.world_size <= 1:
            return running
        flag = torch.tensor(int(running), device=self._device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    # -- generation ------------------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, when the task asks) continuations, cut before the first stop sequence; requests
        with the same generation settings run in left-padded batches (as many on every rank: see the module's
        docstring)."""
        order = lm_utils.Collator(
            [req.args for req in requests],
            sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
            group_by="gen_kwargs",
            group_fn=lambda r: r[1],
        )
        eos = self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False)
        res = []
        chunks = list(order.get_batched(n=self.batch_size))
        for chunk in chunks:
            contexts, settings = zip(*chunk)
            kwargs = lm_utils.normalize_gen_kwargs(dict(settings[0]), MAX_GEN_TOKS)
            until = lm_utils.handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            new = kwargs.pop("max_gen_toks")
            if new >= self.max_length:
                raise UserError(
                    f"a task's generation_kwargs.max_gen_toks {new} leaves no room for a prompt in the model's "
                    f"{self.max_length} positions: give the task a max_gen_toks below {self.max_length}"
                )
            prompts = [self.tok_encode(c)[-(self.max_length - new) :] for c in contexts]
            for context, tokens in zip(contexts, self._generate(prompts, new, until, kwargs)):
                text = lm_utils.postprocess_generated_text(self._decode(tokens), until, None)
                res.append(text)
                self.cache_hook.add_partial("generate_until", (context, settings[0]), text)
        for _ in range(self._pad_to_busiest_rank(len(chunks))):
            while self._any_rank_running(False):  # another rank's batch: forward alongside until it is done
                self._idle_forward()
        return order.get_original(res)

    def _generate(self, prompts: list[list[int]], new: int, until: list[str], kwargs: dict) -> list[list[int]]:
        """Each prompt's new tokens; a row ends at end-of-text (left out) or when its text holds a stop sequence.
        The batch ends when every rank's rows have (a rank done first runs one-token forwards meanwhile)."""
        greedy = not kwargs.get("do_sample") or not kwargs.get("temperature")
        generator = torch.Generator(self._device).manual_seed(int(kwargs.get("seed", 0)))
        steps = batch_steps(
            self.model,
            prompts,
            new,
            temperature=float(kwargs.get("temperature") or 1.0),
            top_p=float(kwargs.get("top_p") or 1.0),
            top_k=int(kwargs.get("top_k") or 0),
            greedy=greedy,
            eos_id=self.eot_token_id,
            generator=None if greedy else generator,
        )
        out: list[list[int]] = [[] for _ in prompts]
        stopped = [False] * len(prompts)
        taken = 0  # steps yielded; batch_steps yields another while a row is neither stopped nor at `new` tokens
        running = new > 0 and bool(prompts)
        with contextlib.closing(steps), self._autocast():
            while self._any_rank_running(running):
                if not running:
                    self._idle_forward()
                    continue
                emitted = next(steps)
                taken += 1
                for r, tok in enumerate(emitted):
                    if tok is None or stopped[r]:
                        continue
                    if tok == self.eot_token_id:
                        stopped[r] = True
                        continue
                    out[r].append(tok)
                    stopped[r] = any(s and s in self._decode(out[r]) for s in until)
                running = taken < new and not all(stopped)
        return out

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # -- several processes -----------------------------------------------------------------------------------------
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size <= 1:
            return tensor
        parts = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, tensor, group=self._group)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        if self.world_size <= 1:
            return [obj]
        result = [None] * self.world_size if self.rank == dst else None
        torch.distributed.gather_object(obj, result, group=self._group, group_dst=dst)
        return result

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier(group=self._group)
