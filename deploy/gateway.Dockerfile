# SGLang's model gateway (smg, from PyPI: a Rust router shipped as a wheel), the router in
# front of Lantern replicas in deploy/compose.yaml and deploy/kubernetes.yaml. The version is
# the one tests/serve.rs runs against Lantern replicas.
FROM python:3.12-slim
RUN pip install --no-cache-dir "smg==1.13.0"
ENTRYPOINT ["smg"]
