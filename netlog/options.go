package netlog

import (
	"fmt"
	"log/slog"
	"math/bits"
	"sync"
	"time"
)

// DefaultSlabSize is the slab size used when Options.SlabSize is 0.
const DefaultSlabSize = 1 << 20

// DefaultPoolKeep is Options.PoolKeep's default: ten times the agent's default snapshot interval
// (60 s), short enough that a log's peak is not held for long after its traffic stopped.
const DefaultPoolKeep = 10 * time.Minute

// Options configure a Store or a Log. The zero value keeps everything in RAM, uncompressed,
// in 1 MiB slabs.
type Options struct {
	// SlabSize is the unit of allocation, compression, spilling and release: a power of two
	// between 256 B and 64 MiB (0 means DefaultSlabSize). Slabs are aligned on absolute
	// sequence numbers, so a Trim frees every slab wholly below the trim point.
	SlabSize int
	// PoolSlabs is how many freed full-size slab buffers are always kept for reuse instead of
	// being handed back to the Go heap (0 means 4, negative means none, not even the ones
	// below). Beyond that, a buffer a Trim or Remove frees is kept until an Age finds it unused
	// for PoolKeep: a log fills and empties at the pace of its receivers' snapshots, so the
	// buffers one snapshot frees are needed again over the next interval, and a buffer handed
	// back to the heap comes back as fresh memory, zeroed and faulted in page by page: logging at
	// 1 Gbit/s with a trim every 20 s cost 1.01 CPU-s per GB when Age handed back what it found
	// unused since the Age before, 0.13 with PoolKeep (ftbench netlog, log_cycle). Pooled
	// buffers never raise memory above its previous peak; they count in PooledBytes.
	PoolSlabs int
	// PoolKeep is how long a pooled buffer beyond PoolSlabs may stay unused before Age hands it
	// back to the Go heap (0 means DefaultPoolKeep). It should exceed the receivers' snapshot
	// interval, within which the log refills.
	PoolKeep time.Duration

	// CompressAfter: Age compresses (lz4 block format) every sealed slab - one whose bytes
	// above the trim point are all present, so it can no longer change - that was sealed at
	// least this long ago. 0 disables age-based compression.
	CompressAfter time.Duration
	// CompressAboveRAM: when raw slab memory exceeds this many bytes, Age also compresses
	// sealed slabs younger than CompressAfter, oldest first. 0 disables it.
	CompressAboveRAM int64

	// SpillDir is where Age spills slabs as a last resort. Empty disables spilling.
	SpillDir string
	// SpillAboveRAM: when raw plus compressed memory, with the stores' overhead (Stats.OverheadBytes),
	// exceeds this many bytes, Age writes the oldest sealed slabs to a file in SpillDir, fsyncs it,
	// then frees their memory.
	// 0 disables spilling.
	SpillAboveRAM int64

	// Logger receives a notice whenever Age spills to disk; nil means slog.Default().
	// Conflicts and failures are returned as errors, not logged.
	Logger *slog.Logger
}

// env is what every store of one Log shares: validated options, the slab pool, the memory
// meter the resource controller reads and the spill file.
type env struct {
	shift    uint
	size     uint32
	opt      Options
	log      *slog.Logger
	pool     slabPool
	meter    meter
	scratch  sync.Pool // *[]byte of len size, for decoding compressed or spilled slabs
	spillMu  sync.Mutex
	spill    *spillFile
	spillErr error
}

func newEnv(opt Options) (*env, error) {
	if opt.SlabSize == 0 {
		opt.SlabSize = DefaultSlabSize
	}
	if opt.SlabSize < 256 || opt.SlabSize > 64<<20 || opt.SlabSize&(opt.SlabSize-1) != 0 {
		return nil, fmt.Errorf("netlog options: SlabSize %d must be a power of two between 256 and %d", opt.SlabSize, 64<<20)
	}
	if opt.PoolKeep < 0 {
		return nil, fmt.Errorf("netlog options: PoolKeep must not be negative")
	}
	if opt.PoolKeep == 0 {
		opt.PoolKeep = DefaultPoolKeep
	}
	switch {
	case opt.PoolSlabs == 0:
		opt.PoolSlabs = 4
	case opt.PoolSlabs < 0:
		opt.PoolSlabs = 0
	}
	if opt.CompressAfter < 0 || opt.CompressAboveRAM < 0 || opt.SpillAboveRAM < 0 {
		return nil, fmt.Errorf("netlog options: CompressAfter, CompressAboveRAM and SpillAboveRAM must not be negative")
	}
	if opt.SpillAboveRAM > 0 && opt.SpillDir == "" {
		return nil, fmt.Errorf("netlog options: SpillAboveRAM is set but SpillDir is empty: name a directory on a local disk")
	}
	e := &env{
		shift: uint(bits.TrailingZeros(uint(opt.SlabSize))),
		size:  uint32(opt.SlabSize),
		opt:   opt,
		log:   opt.Logger,
	}
	if e.log == nil {
		e.log = slog.Default()
	}
	e.pool.max = opt.PoolSlabs
	if opt.PoolSlabs > 0 {
		e.pool.keep = opt.PoolKeep
	}
	e.pool.m = &e.meter
	e.scratch.New = func() any { b := make([]byte, e.size); return &b }
	return e, nil
}

// getSpill opens the spill file on first use.
func (e *env) getSpill() (*spillFile, error) {
	e.spillMu.Lock()
	defer e.spillMu.Unlock()
	if e.spill != nil {
		return e.spill, nil
	}
	if e.spillErr != nil {
		return nil, e.spillErr
	}
	f, err := openSpill(e.opt.SpillDir)
	if err != nil {
		return nil, err
	}
	e.spill = f
	return f, nil
}

func (e *env) closeSpill() error {
	e.spillMu.Lock()
	defer e.spillMu.Unlock()
	e.spillErr = ErrClosed
	if e.spill == nil {
		return nil
	}
	err := e.spill.close()
	e.spill = nil
	return err
}

// slabPool keeps freed full-size slab buffers so a steady stream with regular Trims does not
// allocate (zero, fault in) a fresh MiB per MiB logged: max of them for good, the others until
// they sat unused for keep.
type slabPool struct {
	mu   sync.Mutex
	free []pooledBuf // a stack: get reuses the most recently freed, so the bottom ones are the idle ones
	max  int
	keep time.Duration // 0: none kept beyond max
	m    *meter
}

// pooledBuf is a pooled buffer and when it was freed.
type pooledBuf struct {
	b  []byte
	at time.Time
}

func (p *slabPool) get(size uint32) []byte {
	p.mu.Lock()
	if n := len(p.free); n > 0 {
		b := p.free[n-1].b
		p.free[n-1] = pooledBuf{}
		p.free = p.free[:n-1]
		p.mu.Unlock()
		p.m.pooled.Add(-int64(len(b)))
		return b
	}
	p.mu.Unlock()
	return make([]byte, size)
}

// put pools b, freed at now.
func (p *slabPool) put(b []byte, now time.Time) {
	p.mu.Lock()
	if len(p.free) >= p.max && p.keep == 0 {
		p.mu.Unlock()
		return
	}
	p.free = append(p.free, pooledBuf{b, now})
	p.mu.Unlock()
	p.m.pooled.Add(int64(len(b)))
}

// shrink releases the buffers above max that sat unused for keep at now.
func (p *slabPool) shrink(now time.Time) {
	p.mu.Lock()
	k := 0
	for k < len(p.free)-p.max && now.Sub(p.free[k].at) >= p.keep {
		k++
	}
	var n int64
	for i := range p.free[:k] {
		n += int64(len(p.free[i].b))
		p.free[i] = pooledBuf{}
	}
	p.free = append(p.free[:0], p.free[k:]...)
	clear(p.free[len(p.free):cap(p.free)])
	p.mu.Unlock()
	p.m.pooled.Add(-n)
}

// drain releases every pooled buffer to the Go heap.
func (p *slabPool) drain() {
	p.mu.Lock()
	var n int64
	for i, b := range p.free {
		n += int64(len(b.b))
		p.free[i] = pooledBuf{}
	}
	p.free = p.free[:0]
	p.mu.Unlock()
	p.m.pooled.Add(-n)
}
