"""What the public calls run: the loss on logits (`loss`), the fused LM head's tiles (`head`) and the
float64 reference backend (`reference`). Imports every layer below."""
