"""The vLLM server and its HTTP API: starting a server, the client and its retries, replies and
token-level calls, sampling parameters, API keys, the server's identity.
"""
