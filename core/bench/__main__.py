"""``python -m pagedllm.bench throughput|serve ...``"""

import sys

from pagedllm.bench import main

sys.exit(main())
