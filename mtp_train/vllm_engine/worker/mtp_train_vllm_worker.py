"""A vLLM engine driven by mtp_train over pipes. Runs in vLLM's interpreter (its own virtualenv, or any Python that
imports vllm); imports vLLM, torch and safetensors, never mtp_train.

Started by `mtp_train.vllm_engine.engine.VllmWorker`: its first stdin line is the engine's settings (JSON: `mode`,
`model`, `dtype`, `engine_args`, and per mode what follows), then one request per line. Replies go to the file
descriptor named by $MTP_TRAIN_REPLY_FD, one JSON object a line, so that vLLM's own output (on stdout and stderr, a
log file of the caller's) never mixes with them:

  -> {"ready": {"vllm": version, "dtype": the dtype the engine computes in, "kv_cache_dtype": ..., "device": ...}}
  mode "capture" (settings `layer_ids`, `out_dir`): the target with the speculative method extract_hidden_states
  <- {"op": "capture", "samples": [[token ids], ...]}
  -> {"files": [path, ...]}   one safetensors file a sample, in order: hidden_states [T, len(layer ids), hidden]
                              (the engine's dtype, layer ids ascending) and token_ids [T]
  mode "generate" (settings `speculative_config` or null, `hf_overrides` or null): greedy decoding, batch 1
  <- {"op": "generate", "prompts": [[token ids], ...], "max_new_tokens": n, "stop_token_ids": [...],
      "logprobs": n (optional), "prompt_logprobs": n (optional)}
  -> {"outputs": [[token ids], ...], "seconds": [per prompt]}
     with "logprobs" (asked for): per prompt, per new token [[token id, logprob], ...]: its top n and the chosen
     token, best first (vLLM's raw logprobs); with "prompt_logprobs": the same per prompt token (the first null)
  <- {"op": "metrics"}
  -> {"metrics": {name: value or [values]}}   vLLM's vllm:spec_decode_* counters since the engine started
  -> {"error": "..."}         instead of any reply, then exit 1

The end of stdin (the caller closed it) ends the worker cleanly; SIGTERM (the caller died, or aborts) ends it and
every vLLM process under it at once."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import time
import traceback

CONNECTOR_MODULE = "mtp_train_capture_connector"  # beside this file; the caller puts this directory on PYTHONPATH
CONNECTOR_CLASS = "MtpTrainHiddenStatesConnector"


def _generation_engine(settings: dict):
    from vllm import LLM

    extra = {}
    if settings.get("speculative_config"):
        extra["speculative_config"] = settings["speculative_config"]
    if settings.get("hf_overrides"):
        extra["hf_overrides"] = settings["hf_overrides"]
    return LLM(model=settings["model"], dtype=settings["dtype"], skip_tokenizer_init=True, seed=0,
               disable_log_stats=False,  # the spec-decode counters
               max_num_seqs=1, **extra, **settings.get("engine_args", {}))


def _capture_engine(settings: dict):
    from vllm import LLM

    return LLM(
        model=settings["model"],
        dtype=settings["dtype"],
        skip_tokenizer_init=True,  # prompts are token ids; nothing is detokenized
        enable_prefix_caching=False,  # distinct samples: nothing to reuse, and no cached states to hand back
        seed=0,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": settings["layer_ids"]}},
        },
        kv_transfer_config={
            "kv_connector": CONNECTOR_CLASS,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": settings["out_dir"]},
        },
        **settings.get("engine_args", {}),
    )


def _wait_written(path: str) -> None:
    """The connector holds an exclusive flock on `path`.lock until the file is written (the stock GPU path writes
    from a thread after the request finished); take it shared once, then remove the lock file."""
    lock = path + ".lock"
    if os.path.exists(lock):
        with open(lock) as stream:
            fcntl.flock(stream, fcntl.LOCK_SH)
        os.remove(lock)


def _end_the_group(signum, frame) -> None:
    """SIGTERM (sent by the kernel when the caller dies, or by the caller to abort): end the whole process group,
    which the caller made this worker the leader of, so vLLM's engine processes end with it."""
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _ranked(position) -> list | None:
    """One position's logprobs ({token id: Logprob}, or None) as [[token id, logprob], ...], best first."""
    if position is None:
        return None
    return [[int(token), float(entry.logprob)] for token, entry in
            sorted(position.items(), key=lambda item: -item[1].logprob)]


def _generate(llm, request: dict) -> dict:
    """Greedy decoding, one prompt at a time (batch 1, as mtp_train's eval), each timed; with `logprobs` or
    `prompt_logprobs` (n) the top n logprobs of every new or prompt token as well."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    logprobs, prompt_logprobs = request.get("logprobs"), request.get("prompt_logprobs")
    params = SamplingParams(temperature=0.0, max_tokens=request["max_new_tokens"],
                            stop_token_ids=request.get("stop_token_ids") or None, detokenize=False,
                            logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    reply = {"outputs": [], "seconds": []}
    if logprobs is not None:
        reply["logprobs"] = []
    if prompt_logprobs is not None:
        reply["prompt_logprobs"] = []
    for ids in request["prompts"]:
        started = time.perf_counter()
        result = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        reply["seconds"].append(time.perf_counter() - started)
        reply["outputs"].append(list(result.outputs[0].token_ids))
        if logprobs is not None:
            reply["logprobs"].append([_ranked(position) for position in result.outputs[0].logprobs])
        if prompt_logprobs is not None:
            reply["prompt_logprobs"].append([_ranked(position) for position in result.prompt_logprobs])
    return reply


def _spec_metrics(llm) -> dict:
    metrics = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            metrics[metric.name] = list(metric.values) if hasattr(metric, "values") else metric.value
    return metrics


def main() -> int:
    signal.signal(signal.SIGTERM, _end_the_group)
    reply = os.fdopen(int(os.environ["MTP_TRAIN_REPLY_FD"]), "w", buffering=1)

    def send(message: dict) -> None:
        reply.write(json.dumps(message) + "\n")
        reply.flush()

    try:
        settings = json.loads(sys.stdin.readline())
        # vLLM is imported here and in the engine builders, inside this try: a failed import is answered with
        # the {"error": ...} reply the caller reads, not a bare traceback.
        import vllm
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        mode = settings.get("mode")
        if mode not in ("capture", "generate"):
            raise ValueError(f"unknown mode {mode!r}")
        llm = _capture_engine(settings) if mode == "capture" else _generation_engine(settings)
        config = llm.llm_engine.vllm_config
        send({"ready": {"vllm": vllm.__version__, "dtype": str(config.model_config.dtype).removeprefix("torch."),
                        "kv_cache_dtype": str(config.cache_config.cache_dtype),
                        "device": str(config.device_config.device_type)}})
        # One new token per sample: the prefill computes (and captures) every prompt position.
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        for line in sys.stdin:
            request = json.loads(line)
            op = request.get("op")
            if mode == "generate" and op == "generate":
                send(_generate(llm, request))
                continue
            if mode == "generate" and op == "metrics":
                send({"metrics": _spec_metrics(llm)})
                continue
            if mode != "capture" or op != "capture":
                raise ValueError(f"request {op!r} in mode {mode!r}")
            prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["samples"]]
            outputs = llm.generate(prompts, params, use_tqdm=False)  # in the order of the prompts
            files = []
            for output in outputs:
                path = (output.kv_transfer_params or {}).get("hidden_states_path")
                if path is None:
                    raise RuntimeError(f"vLLM returned no hidden-states file for request {output.request_id}")
                _wait_written(path)
                files.append(path)
            send({"files": files})
    except Exception as err:  # said to the caller, which names the log holding the traceback
        traceback.print_exc()
        send({"error": f"{type(err).__name__}: {err}"})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
