"""Embed images with an exported PUMA model, needing only onnxruntime, numpy and Pillow.

    python onnx_embed.py model.onnx photo1.jpg photo2.jpg ...   # writes embeddings.npy (N, E)
"""
import json
import sys

import numpy as np
import onnxruntime as ort
from PIL import Image, ImageOps

session = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
meta = session.get_modelmeta().custom_metadata_map
size, shorter = int(meta["puma.img_size"]), int(meta["puma.resize_shorter"])
mean, std = (np.array(json.loads(meta[k]), np.float32)[:, None, None] for k in ("puma.mean", "puma.std"))


def view(path: str) -> np.ndarray:
    """The model's eval view: shorter side to `shorter`, center crop `size`, normalised, channels first."""
    img = Image.open(path)
    if img.format == "JPEG":
        img.draft(None, (shorter, shorter))  # decode at the DCT scale the view needs
    img = ImageOps.exif_transpose(img).convert("RGB")
    f = shorter / min(img.size)
    left = round((round(img.width * f) - size) / 2) / f
    top = round((round(img.height * f) - size) / 2) / f
    img = img.resize((size, size), Image.Resampling.BICUBIC, box=(left, top, left + size / f, top + size / f))
    return (np.asarray(img, np.float32).transpose(2, 0, 1) / 255 - mean) / std


embeddings = session.run(["embeddings"], {"images": np.stack([view(p) for p in sys.argv[2:]])})[0]
np.save("embeddings.npy", embeddings)
print(f"{embeddings.shape[0]} embeddings of size {embeddings.shape[1]} (model {meta['puma.model_id']})")
