# The policyd daemon and the Streamlit dashboard (one image, two commands; compose.yaml).
# The connector does not need this image: vLLM's own image mounts connector/ and policyd/.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY policyd ./policyd
COPY experiments ./experiments
COPY connector ./connector
COPY ui ./ui
COPY examples ./examples
COPY migrations ./migrations
# editable: policyd.history finds migrations/ next to the policyd package. AGENTKV_COMPILE=1:
# the predictor compiled with Cython from the same source (setup.py; about a quarter less CPU
# per call, the same forecasts: make bench-predictor), with a C compiler only while building.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && AGENTKV_COMPILE=1 pip install --no-cache-dir -e '.[ui]' \
    && python -c "import policyd.models.predictor as p; assert p.BUILD == 'compiled', p.BUILD" \
    && apt-get purge -y --auto-remove gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* build
ENV POLICYD_DB=/var/lib/agentkv/history.duckdb
VOLUME /var/lib/agentkv
EXPOSE 8470 5557 5558 8501
CMD ["policyd", "serve", "--http-host", "0.0.0.0", "--events", "tcp://0.0.0.0:5557", "--snapshots", "tcp://0.0.0.0:5558"]
