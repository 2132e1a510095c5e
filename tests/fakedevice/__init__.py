

def plan_and_layers(device, method, q, cache, batch, layer, layers):
    """One step of ``method`` (an attention method or a scored compressor's attention): its
    plan once, then ``layers`` forwards, each in a region of its own (where the device counts
    the host syncs). Returns (plan, the layers' outputs)."""
    with device.region("plan (step)"):
        plan = method.plan(batch)
    outs = []
    for i in range(layers):
        with device.region(f"layer {i}"):
            outs.append(method.forward(q, cache, batch, layer, plan))
    return plan, outs
