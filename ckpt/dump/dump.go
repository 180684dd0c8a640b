// Package dump takes a snapshot of a running job into a ckpt store: the CRIU dump, the TCP connections
// and open files read back from its images, a copy of the job's output files and the job's record,
// between the store's Begin and Commit. What only its caller knows (the bytes a connection had sent, who
// the job is) comes in through Options; the caller decides when to snapshot and where to ship it.
package dump

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/criu"
	"github.com/ftkit/ftkit/criu/image"
	"github.com/ftkit/ftkit/internal/atomicfile"
)

// Layout of a snapshot directory (the ckpt store adds manifest.json and the checksums).
const (
	ImagesDir  = "images"   // CRIU's images
	OutputsDir = "outputs"  // the job's output files, up to their sizes at the dump
	JobFile    = "job.json" // the job record, so that any host can restore the job
)

// Dumper runs a CRIU dump (criu.Client does).
type Dumper interface {
	Dump(ctx context.Context, opts criu.DumpOptions) (criu.DumpStats, error)
}

// SentPrefixFunc returns what the job had written, before the dump, in the receive-digest block holding
// connection c's write_seq (ckpt.Conn.SentPrefix); images is the dump's images directory. It returns nil
// and no error for a connection nobody will check (a peer on this host or outside the cluster).
type SentPrefixFunc func(ctx context.Context, images string, c image.TCPConn) (*ckpt.SentPrefix, error)

// Options says what to dump and what the caller knows about it.
type Options struct {
	Job string // the job's id: the store's key
	PID int    // root of the process tree
	// FreezeCgroup, if set, is the job's cgroup, which the caller froze (semi-coordinated): CRIU dumps it
	// frozen and leaves it frozen. Otherwise the job keeps running during the dump.
	FreezeCgroup string
	// SkipMounts are mount points of the job's namespace the dump leaves out (criu.DumpOptions.SkipMounts).
	SkipMounts []string
	// Info carries what the caller records about the dump (CRIU version, kernel, mode); Take fills in
	// the dump's duration and statistics, connections and open files.
	Info ckpt.Info
	// Record is the job record, written as JobFile in JSON.
	Record any
	// SentPrefix, if set, is asked for each connection of the dump.
	SentPrefix SentPrefixFunc
	// Outputs is the job directory whose output files travel with the snapshot.
	Outputs Outputs
	// Dumped, if set, is called as soon as CRIU returns, whatever it returned: the caller that froze the
	// job for the dump thaws it there, before the images are read and committed.
	Dumped func()
	// HashWhileDumping hashes CRIU's memory images as the dump writes them (pagesFollower) instead of
	// after it: the snapshot is ready a hash pass sooner, at the price of that pass competing with CRIU
	// for the CPU (a migration's stop counts both; a running job's snapshot prefers CRIU alone).
	HashWhileDumping bool
	Logger           *slog.Logger
}

// Take dumps the job with d into a new snapshot of store and commits it. On any error nothing is left in
// the store.
func Take(ctx context.Context, store *ckpt.Store, d Dumper, opts Options) (m *ckpt.Manifest, err error) {
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	p, err := store.Begin(opts.Job)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			p.Abort()
		}
	}()
	images := filepath.Join(p.Dir(), ImagesDir)
	if err := os.Mkdir(images, 0o700); err != nil {
		return nil, err
	}
	var follower *pagesFollower
	if opts.HashWhileDumping {
		follower = followPages(images)
	}
	start := time.Now()
	stats, err := d.Dump(ctx, criu.DumpOptions{
		PID: opts.PID, ImagesDir: images, LeaveRunning: true, FreezeCgroup: opts.FreezeCgroup, SkipMounts: opts.SkipMounts,
	})
	took := time.Since(start)
	if opts.Dumped != nil {
		opts.Dumped()
	}
	if follower != nil {
		hashed, ferr := follower.finish()
		if ferr != nil && err == nil {
			log.Warn("memory images not hashed during the dump; the commit hashes them", "job", opts.Job, "err", ferr)
		}
		for name, h := range hashed {
			p.Written(ImagesDir+"/"+name, h.size, h.sha256)
		}
	}
	if err != nil {
		return nil, err
	}
	conns, err := image.TCPConnections(images)
	if err != nil {
		return nil, fmt.Errorf("read TCP state from the images: %w", err)
	}
	files, err := image.RegularFiles(images)
	if err != nil {
		return nil, fmt.Errorf("read open files from the images: %w", err)
	}
	info := opts.Info
	info.DumpDuration = took
	info.Stats = ckpt.DumpStats{
		FreezingTime: us(stats.FreezingUS), FrozenTime: us(stats.FrozenUS), MemdumpTime: us(stats.MemdumpUS),
		MemwriteTime: us(stats.MemwriteUS), PagesScanned: stats.PagesScanned, PagesWritten: stats.PagesWritten,
	}
	info.Conns, info.OpenFiles = nil, nil
	for _, c := range conns {
		var prefix *ckpt.SentPrefix
		if opts.SentPrefix != nil && !c.Connecting() { // a connecting socket sent no byte yet
			var err error
			if prefix, err = opts.SentPrefix(ctx, images, c); err != nil {
				prefix = nil
				log.Warn("the bytes before the snapshot's write_seq in its digest block are unknown: a restore that re-sends bytes on this connection will be refused as unverifiable",
					"job", opts.Job, "conn", c.Tuple, "err", err)
			}
		}
		info.Conns = append(info.Conns, ckpt.Conn{
			Tuple: c.Tuple, Inode: uint64(c.Inode), InqSeq: c.InqSeq, InqLen: c.InqLen,
			OutqSeq: c.OutqSeq, OutqLen: c.OutqLen, Timestamp: c.Timestamp, Connecting: c.Connecting(), FinUnacked: c.FinUnacked(),
			SentPrefix: prefix,
		})
	}
	if err := refuseUnsized(opts.Job, files); err != nil {
		return nil, err
	}
	info.OpenFiles = WrittenFiles(files)
	// The job's own output files travel with the snapshot: a host without the job directory (no shared
	// file system) recreates them before restoring.
	if err := copyOutputs(opts.Job, opts.Outputs, info.OpenFiles, filepath.Join(p.Dir(), OutputsDir)); err != nil {
		return nil, err
	}
	if err := atomicfile.WriteJSON(filepath.Join(p.Dir(), JobFile), opts.Record); err != nil {
		return nil, err
	}
	m, err = p.Commit(ctx, info)
	if err != nil {
		return nil, err
	}
	log.Info("snapshot taken", "job", opts.Job, "snapshot", m.ID, "dump_ms", took.Milliseconds(),
		"frozen_ms", info.Stats.FrozenTime.Milliseconds(), "pages_written", stats.PagesWritten,
		"bytes", m.TotalSize(), "tcp_conns", len(conns))
	return m, nil
}

// WrittenFiles is the recovery contract's part of a dump's regular files: those the job opened for
// writing (restore truncates them back). Read-only files, the job's binaries and libraries among them,
// must never be touched: CRIU checks their sizes itself. So are files deleted before the dump: CRIU restores
// them from its ghost copy or through a link it made, never by their old name, which may name another of the
// user's files by then.
func WrittenFiles(files []image.RegFile) []ckpt.OpenFile {
	var out []ckpt.OpenFile
	for _, f := range files {
		if f.HasSize && f.Flags&syscall.O_ACCMODE != syscall.O_RDONLY && !f.Deleted {
			out = append(out, ckpt.OpenFile{Path: f.Path, Size: int64(f.Size)})
		}
	}
	return out
}

// refuseUnsized refuses a dump in which the job holds a regular file (or one of unknown type) open for
// writing with no size in the images: WrittenFiles would leave it out, no restore could cut what the job
// wrote to it after the snapshot, and the restored job would write those bytes a second time, silently.
// CRIU 4.2.1 records no size for a file open write-only with O_APPEND (it takes it for a log); ftkit's
// patch 0009 makes it record one, so only a CRIU without ftkit's patches gets here.
func refuseUnsized(job string, files []image.RegFile) error {
	for _, f := range files {
		if f.HasSize || f.Flags&syscall.O_ACCMODE == syscall.O_RDONLY {
			continue
		}
		if f.HasMode && f.Mode&syscall.S_IFMT != syscall.S_IFREG {
			continue // a device (/dev/null) or the like: no bytes to repeat
		}
		return fmt.Errorf("job %s has %s open for writing (flags %#o) and CRIU recorded no size for it (a CRIU without ftkit's patch 0009 takes a write-only O_APPEND file for a log): "+
			"a restore could not cut what the job writes to it after the snapshot, and the restored job would write that twice; install CRIU with `make setup`",
			job, f.Path, f.Flags)
	}
	return nil
}

func us(v uint32) time.Duration { return time.Duration(v) * time.Microsecond }
