# Outbox: one image for the API, the dispatcher, the reconciler and the fake provider.
# Build stage: wheels need a compiler only for packages without binary wheels.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY outbox ./outbox
COPY adapters ./adapters
COPY reconciler ./reconciler
COPY fake_provider ./fake_provider
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

# Runtime stage: no build tools, a non-root user.
FROM python:3.11-slim
RUN useradd --create-home --uid 10001 outbox
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
COPY deploy/adapters.toml /etc/outbox/adapters.toml
USER outbox
WORKDIR /home/outbox
ENV OUTBOX_ADAPTERS=/etc/outbox/adapters.toml \
    PYTHONUNBUFFERED=1
EXPOSE 8000 9000 9100 9101
CMD ["outbox", "serve", "--host", "0.0.0.0", "--port", "8000"]
