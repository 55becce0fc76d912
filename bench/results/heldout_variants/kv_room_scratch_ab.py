import sys
sys.path.insert(0, 'bench/results/heldout_variants'); sys.path.insert(0, '.')
import kv_room_scratch  # noqa
from bench.sim import ab
if __name__ == "__main__":
    sys.exit(ab.main(sys.argv[1:]))
