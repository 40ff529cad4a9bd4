"""One rank of allreduce_run.py: RANK WORLD MASTER_IP REPEATS."""
import os, sys, time, json, torch, torch.distributed as dist
rank, world, master = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
dist.init_process_group("gloo", init_method=f"tcp://{master}:29555", rank=rank, world_size=world)
t = torch.zeros(1_093_672 // 4)
t2 = torch.zeros(4992 // 4)
ts = []
for i in range(int(sys.argv[4])):
    time.sleep(0.1)
    dist.barrier()
    t0 = time.monotonic(); dist.all_reduce(t); dist.all_reduce(t2); ts.append(time.monotonic() - t0)
if rank == 0:
    print(json.dumps(ts))
dist.destroy_process_group()
