"""Measurement beside the pipeline: what speculative decoding's steps cost on this machine (`costs`: the eval's cost
curve when `eval.cost_curve` asks for it, and the bench scripts' step timings). The stages log their own speed and
call nothing here unless asked."""
