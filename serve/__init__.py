"""The OpenAI-compatible HTTP server (`jspec serve`) and an HTTP load driver.

Modules: ``protocol`` (request checking, response bodies), ``app`` (aiohttp routes over an
``AsyncLLMEngine``), ``server`` (life cycle: warm-up before ready, graceful shutdown),
``metrics`` (Prometheus), ``client`` (drive a live server, per-request timings). Nothing is
imported here: aiohttp and prometheus_client are the optional ``serve`` extra.
"""
