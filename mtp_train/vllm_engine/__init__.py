"""vLLM as the target engine: the target's forward run by vLLM (its kernels, its parallelism, its numerics), in its
own interpreter, driven from here over pipes (`capture.VllmCapture`). `worker/` holds what runs inside vLLM's
interpreter; it imports vLLM and never mtp_train, so that vLLM's pinned dependencies and ours never meet."""
