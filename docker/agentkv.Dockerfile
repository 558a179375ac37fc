# The policyd daemon and the Streamlit dashboard (one image, two commands; compose.yaml).
# The connector does not need this image: vLLM's own image mounts connector/ and policyd/.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY policyd ./policyd
COPY connector ./connector
COPY ui ./ui
COPY migrations ./migrations
# editable: policyd.history finds migrations/ next to the policyd package
RUN pip install --no-cache-dir -e '.[ui]'
ENV POLICYD_DB=/var/lib/agentkv/history.duckdb
VOLUME /var/lib/agentkv
EXPOSE 8470 5557 5558 8501
CMD ["policyd", "serve", "--http-host", "0.0.0.0", "--events", "tcp://0.0.0.0:5557", "--snapshots", "tcp://0.0.0.0:5558"]
