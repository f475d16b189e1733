"""``compress bench serve``: an offline equivalent of ``vllm bench serve``. A seeded
synthetic workload (``workload``) is sent as token ids to OpenAI-compatible servers
(``peers``: our ``compress serve``, the same one request at a time, and llama.cpp's
``llama-server``) by an asyncio streaming client (``client``) that times every token
chunk; ``report`` turns the timings into TTFT / TPOT / ITL / end-to-end percentiles,
request and token throughput, ratios between the peers, JSON and a markdown table;
``command`` is the CLI that runs it all."""
