"""One rank of allreduce_run.py: RANK WORLD MASTER_IP REPEATS [SIZES].
Without SIZES, times DDP's two buckets for digits-wide back to back and prints a list of seconds.
With SIZES (comma-separated bytes), times one all-reduce of each size and prints {size: [seconds]}."""
import os, sys, time, json, torch, torch.distributed as dist
rank, world, master, reps = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
dist.init_process_group("gloo", init_method=f"tcp://{master}:29555", rank=rank, world_size=world)


def timed(tensors):
    ts = []
    for _ in range(reps):
        time.sleep(0.1)
        dist.barrier()
        t0 = time.monotonic()
        for t in tensors:
            dist.all_reduce(t)
        ts.append(time.monotonic() - t0)
    return ts


if len(sys.argv) > 5:
    out = {int(s): timed([torch.zeros(int(s) // 4)]) for s in sys.argv[5].split(",")}
else:
    out = timed([torch.zeros(1_093_672 // 4), torch.zeros(4992 // 4)])
if rank == 0:
    print(json.dumps(out))
dist.destroy_process_group()
