#!/usr/bin/env python3
"""CI check: every deploy manifest parses, and each Kubernetes document names its kind."""
import pathlib
import sys

import yaml

root = pathlib.Path(__file__).parent
failed = False
for path in sorted(root.rglob("*.y*ml")):
    try:
        documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except yaml.YAMLError as error:
        print(f"{path}: {error}")
        failed = True
        continue
    if "k8s" in path.parts:
        for document in documents:
            if not {"apiVersion", "kind", "metadata"} <= document.keys():
                print(f"{path}: a document lacks apiVersion, kind or metadata")
                failed = True
        for document in documents:
            if document.get("kind") == "ConfigMap":
                for name, text in document.get("data", {}).items():
                    if name.endswith((".yml", ".yaml")):
                        yaml.safe_load(text)
    print(f"{path.relative_to(root)}: {len(documents)} document(s) ok")

# The Kubernetes ConfigMap carries the same tidemark.toml as compose (comments aside); the
# coordinator's own parser checks deploy/tidemark.toml in `cargo test` (config tests).
def settings(text):
    return [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]

configmap = next(yaml.safe_load_all((root / "k8s" / "configmap.yaml").read_text()))
if settings(configmap["data"]["tidemark.toml"]) != settings((root / "tidemark.toml").read_text()):
    print("k8s/configmap.yaml: tidemark.toml differs from deploy/tidemark.toml")
    failed = True
sys.exit(1 if failed else 0)
