"""shadow-vllm: vLLM's own OpenAI server as an engine of a shadow pair.

``shadow-vllm serve MODEL [vllm serve's arguments]`` builds vLLM's engine
fully (weights, KV cache, warm-up requests through the HTTP path, vLLM's
startup hook), says ``STATUS=parked``, blocks on the pair's election lock,
then serves on the pair's listening socket and says ``READY=1``
(docs/engine-contract.md). Without the runtime's variables it is
``vllm serve``.

Modules: ``cli`` (the command), ``pair`` (the contract's steps, no vLLM),
``lock`` (how the lock is held), ``vllm_glue`` (every vLLM internal relied
on, for one pinned vLLM version), ``plugin`` (vLLM's general plugin: the
EngineCore's watchdog pings, the parent-death watch), ``parentwatch``,
``tiny_model`` (a random-weight Llama made offline, for tests).
"""
