# vLLM's official OpenAI server with AgentKV's connector installed as a package: its own
# distribution (packaging/agentkv-connector), which registers the connector through vLLM's
# plugin entry point, so --kv-transfer-config names "AgentKVConnector" with no module path.
FROM python:3.12-slim AS wheel
WORKDIR /src
COPY packaging/agentkv-connector ./packaging/agentkv-connector
COPY connector ./connector
COPY policyd/__init__.py ./policyd/
COPY policyd/core/__init__.py policyd/core/types.py policyd/core/wire.py policyd/core/client.py ./policyd/core/
COPY policyd/tiers ./policyd/tiers
RUN pip install --no-cache-dir "setuptools>=70.1" \
    && python packaging/agentkv-connector/build.py --out /wheels

FROM vllm/vllm-openai:v0.32.0
COPY --from=wheel /wheels /tmp/wheels
RUN python3 -m pip install --no-cache-dir /tmp/wheels/*.whl && rm -rf /tmp/wheels
