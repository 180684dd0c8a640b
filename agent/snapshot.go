package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"time"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/ckpt/ship"
	"github.com/ftkit/ftkit/criu"
	"github.com/ftkit/ftkit/criu/image"
	"github.com/ftkit/ftkit/internal/atomicfile"
	"github.com/ftkit/ftkit/internal/jobfs"
	"github.com/ftkit/ftkit/internal/version"
	"github.com/ftkit/ftkit/netlog"
)

// Layout of a snapshot directory (the ckpt store adds manifest.json and the checksums).
const (
	snapImages  = "images"   // CRIU's images
	snapOutputs = "outputs"  // the job's output files, up to their sizes at the dump
	snapJob     = "job.json" // the job record, so that any host can restore the job
)

// SnapshotResult describes one snapshot taken by this agent.
type SnapshotResult struct {
	Manifest *ckpt.Manifest `json:"manifest"`
	Shipped  bool           `json:"shipped"`
	ShipErr  string         `json:"ship_error,omitempty"`
	// Shipping cost: snapshot bytes, bytes on the wire (lz4), and wall time.
	ShipBytes    int64         `json:"ship_bytes,omitempty"`
	ShipWire     int64         `json:"ship_wire_bytes,omitempty"`
	ShipDuration time.Duration `json:"ship_duration_ns,omitempty"`
}

// snapshot dumps one running job and keeps it running (uncoordinated). If frozen, the caller froze the
// job's cgroup (semi-coordinated): CRIU dumps it frozen and leaves it frozen.
func (a *Agent) snapshot(ctx context.Context, j Job, frozen bool) (*ckpt.Manifest, error) {
	p, err := a.store.Begin(j.ID)
	if err != nil {
		return nil, err
	}
	committed := false
	defer func() {
		if !committed {
			p.Abort()
		}
	}()
	images := filepath.Join(p.Dir(), snapImages)
	if err := os.Mkdir(images, 0o700); err != nil {
		return nil, err
	}
	opts := criu.DumpOptions{PID: j.PID, ImagesDir: images, LeaveRunning: true}
	if frozen {
		opts.FreezeCgroup = j.Cgroup
	}
	start := time.Now()
	stats, err := a.criu.Dump(ctx, opts)
	took := time.Since(start)
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
	info := ckpt.Info{
		CRIUVersion: a.criuVersion.String(), KernelRelease: version.KernelRelease(), Mode: a.cfg.Checkpoint.Mode,
		DumpDuration: took,
		Stats: ckpt.DumpStats{
			FreezingTime: us(stats.FreezingUS), FrozenTime: us(stats.FrozenUS), MemdumpTime: us(stats.MemdumpUS),
			MemwriteTime: us(stats.MemwriteUS), PagesScanned: stats.PagesScanned, PagesWritten: stats.PagesWritten,
		},
	}
	for _, c := range conns {
		var prefix *ckpt.SentPrefix
		var err error
		// Only a peer on another member survives this host and checks what a restore re-sends to it.
		if owner := a.memberByIP(c.Remote.Addr()); owner != "" && owner != a.cfg.Name {
			prefix, err = a.sentPrefix(ctx, images, c)
		}
		if err != nil {
			a.log.Warn("the bytes before the snapshot's write_seq in its digest block are unknown: a restore that re-sends bytes on this connection will be refused as unverifiable",
				"job", j.ID, "conn", netlog.Conn{Src: c.Local, Dst: c.Remote}, "err", err)
		}
		info.Conns = append(info.Conns, ckpt.Conn{
			Local: c.Local, Remote: c.Remote, Inode: uint64(c.Inode), InqSeq: c.InqSeq, InqLen: c.InqLen,
			OutqSeq: c.OutqSeq, OutqLen: c.OutqLen, Timestamp: c.Timestamp, SentPrefix: prefix,
		})
	}
	// Only files the job opened for writing are part of the recovery contract (restore truncates them
	// back). Read-only files, the job's binaries and libraries among them, must never be touched: CRIU
	// checks their sizes itself.
	for _, f := range files {
		if f.HasSize && f.Flags&syscall.O_ACCMODE != syscall.O_RDONLY {
			info.OpenFiles = append(info.OpenFiles, ckpt.OpenFile{Path: f.Path, Size: int64(f.Size)})
		}
	}
	// The job's own output files travel with the snapshot: a host without the job directory (no shared
	// file system) recreates them before restoring.
	if err := a.copyOutputs(j, info.OpenFiles, filepath.Join(p.Dir(), snapOutputs)); err != nil {
		return nil, err
	}
	if err := atomicfile.WriteJSON(filepath.Join(p.Dir(), snapJob), j); err != nil {
		return nil, err
	}
	m, err := p.Commit(ctx, info)
	if err != nil {
		return nil, err
	}
	committed = true
	a.log.Info("snapshot taken", "job", j.ID, "snapshot", m.ID, "dump_ms", took.Milliseconds(),
		"frozen_ms", info.Stats.FrozenTime.Milliseconds(), "pages_written", stats.PagesWritten,
		"bytes", m.TotalSize(), "tcp_conns", len(conns))
	return m, nil
}

func us(v uint32) time.Duration { return time.Duration(v) * time.Microsecond }

// copyOutputs copies the first Size bytes of each of the job's outputs in its directory. The job appends
// only, so those bytes no longer change while it keeps running. Root reads them through no link and only
// from the job's own regular files: a job directory an older agent handed to the user may hold anything.
func (a *Agent) copyOutputs(j Job, files []ckpt.OpenFile, dst string) error {
	l := a.layout()
	var dir *jobfs.Dir
	defer func() {
		if dir != nil {
			dir.Close()
		}
	}()
	copied := map[string]bool{}
	for _, f := range files {
		name, inside := l.outputName(j.ID, f.Path)
		if !inside {
			continue // not the job's own output: it must exist on the restoring host
		}
		if name == "" {
			return fmt.Errorf("job %s has %s open for writing inside its job directory, where only %s and %s are its own; no restore could recreate it",
				j.ID, f.Path, stdoutName, stderrName)
		}
		if copied[name] { // opened more than once
			continue
		}
		copied[name] = true
		if dir == nil {
			var err error
			if dir, err = jobfs.OpenDir(l.dir(j.ID)); err != nil {
				return fmt.Errorf("copy job outputs: %w", err)
			}
			if err := os.MkdirAll(dst, 0o700); err != nil {
				return err
			}
		}
		in, err := dir.OpenOwned(name, os.O_RDONLY, j.UID)
		if err != nil {
			return fmt.Errorf("copy job output: %w", err)
		}
		err = copyPrefixToNew(filepath.Join(dst, name), in, f.Size)
		in.Close()
		if err != nil {
			return fmt.Errorf("copy job output %s: %w", f.Path, err)
		}
	}
	return nil
}

// copyPrefixToNew copies the first n bytes of src into a new file dst (0600: it may hold anything the job
// wrote), which must not exist yet.
func copyPrefixToNew(dst string, src io.Reader, n int64) error {
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY|syscall.O_NOFOLLOW, 0o600)
	if err != nil {
		return err
	}
	if err := copyPrefix(out, src, n); err != nil {
		out.Close()
		os.Remove(dst)
		return err
	}
	return out.Close()
}

// copyPrefix copies exactly n bytes from src to dst.
func copyPrefix(dst io.Writer, src io.Reader, n int64) error {
	if _, err := io.CopyN(dst, src, n); err != nil {
		return fmt.Errorf("file shorter than its size at the dump (%d bytes): %w", n, err)
	}
	return nil
}

// shipToProtector streams a committed snapshot to this node's protector and records the replica. If the
// protector does not answer, the next node of the ring takes its place, so the ring re-forms around a
// member that left.
func (a *Agent) shipToProtector(ctx context.Context, m *ckpt.Manifest) (*ship.Sent, error) {
	var errs []error
	v := a.View()
	for prot, ok := v.Protector(a.cfg.Name); ; prot, ok = v.Protector(prot.Name) {
		if !ok || prot.Name == a.cfg.Name {
			errs = append(errs, errors.New("no other node left in the ring"))
			return nil, fmt.Errorf("ship %s: %w", m.ID, errors.Join(errs...))
		}
		sent, err := a.shipTo(ctx, prot.Name, m)
		if err == nil {
			return sent, nil
		}
		errs = append(errs, err)
		var remote *ship.RemoteError
		if errors.As(err, &remote) || ctx.Err() != nil {
			return nil, errors.Join(errs...) // the protector answered and refused: do not go around it
		}
		a.log.Warn("protector unreachable; trying the next node of the ring", "protector", prot.Name, "err", err)
	}
}

func (a *Agent) shipTo(ctx context.Context, peer string, m *ckpt.Manifest) (*ship.Sent, error) {
	// A protector that does not accept the connection in time is skipped (the next node of the ring takes
	// the replica); the transfer itself may take as long as it needs.
	dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	c, err := a.peers().Ship(dctx, peer)
	cancel()
	if err != nil {
		return nil, fmt.Errorf("ship %s to %s: %w", m.ID, peer, err)
	}
	defer c.Close()
	sent, err := ship.Send(ctx, c, a.store, m.Job, m.ID, ship.SendOptions{Peer: peer, Logger: a.log})
	if err != nil {
		return nil, fmt.Errorf("ship %s to %s: %w", m.ID, peer, err)
	}
	a.log.Info("snapshot shipped", "job", m.Job, "snapshot", m.ID, "protector", peer, "bytes", sent.Bytes,
		"wire_bytes", sent.WireBytes, "ms", sent.Duration.Milliseconds(),
		"mb_per_s", float64(sent.Bytes)/1e6/max(sent.Duration.Seconds(), 1e-6))
	return sent, nil
}

// Checkpoint snapshots the given running jobs now (all of this host's if ids is empty), ships each
// snapshot, and prunes old ones. In semi-coordinated mode all of them are frozen together first.
func (a *Agent) Checkpoint(ctx context.Context, ids []string, uid uint32) ([]SnapshotResult, error) {
	var jobs []Job
	for _, j := range a.Jobs(uid) {
		if j.State == JobRunning && (len(ids) == 0 || slices.Contains(ids, j.ID)) {
			jobs = append(jobs, j)
		}
	}
	if len(ids) > 0 && len(jobs) != len(ids) {
		return nil, fmt.Errorf("%w: some of %v are not running on %s", ErrNoJob, ids, a.cfg.Name)
	}
	a.ckptMu.Lock()
	defer a.ckptMu.Unlock()
	var manifests []*ckpt.Manifest
	var errs []error
	if a.cfg.Checkpoint.Mode == SemiCoordinated {
		ms, err := a.semiCoordinated(ctx, jobs)
		manifests, errs = ms, append(errs, err)
	} else {
		for _, j := range jobs {
			// No retry: the one transient failure seen (two parasites racing to mkdir "/proc.crtools", EEXIST)
			// cannot happen since each job has a /proc of its own (jobinit.go).
			m, err := a.snapshot(ctx, j, false)
			if err != nil {
				errs = append(errs, fmt.Errorf("job %s: %w", j.ID, err))
				continue
			}
			a.policyFor(j.ID).Observe(time.Duration(m.DumpDuration))
			manifests = append(manifests, m)
		}
	}
	var out []SnapshotResult
	for _, m := range manifests {
		res := SnapshotResult{Manifest: m}
		sent, err := a.shipToProtector(ctx, m)
		if err != nil {
			res.ShipErr = err.Error()
			a.log.Warn("snapshot not replicated", "job", m.Job, "snapshot", m.ID, "err", err)
		} else {
			res.Manifest, res.Shipped = sent.Manifest, true
			res.ShipBytes, res.ShipWire, res.ShipDuration = sent.Bytes, sent.WireBytes, sent.Duration
			a.recordReplica(sent.Manifest) // the job is protected from here on
			// Durable on the protector: the senders may now drop what the snapshot before it had received
			// (this one's, if a sender asked for it under log pressure).
			if base := a.releaseBase(sent.Manifest, a.asked.Load()); base != nil {
				a.announceReceivePoints(ctx, base)
			}
			if pruned, err := a.store.Prune(ctx, m.Job, a.cfg.Checkpoint.Keep); err != nil {
				a.log.Warn("prune snapshots", "job", m.Job, "err", err)
			} else if len(pruned) > 0 {
				a.log.Debug("pruned snapshots", "job", m.Job, "ids", pruned)
			}
		}
		out = append(out, res)
	}
	return out, errors.Join(errs...)
}

// Snapshots lists the snapshots held on this host, newest first: its jobs' own and the replicas it keeps
// as a protector. A non-root caller sees only snapshots of its own jobs.
func (a *Agent) Snapshots(job string, uid uint32) ([]*ckpt.Manifest, error) {
	jobs := []string{job}
	if job == "" {
		var err error
		if jobs, err = a.store.Jobs(); err != nil {
			return nil, err
		}
	}
	var out []*ckpt.Manifest
	for _, jid := range jobs {
		ids, err := a.store.List(jid, "")
		if err != nil {
			return nil, err
		}
		for _, id := range ids {
			m, err := a.store.Manifest(jid, id)
			if err != nil {
				a.log.Warn("unreadable snapshot manifest", "job", jid, "snapshot", id, "err", err)
				continue
			}
			if uid != 0 && !a.ownsSnapshot(m, uid) {
				continue
			}
			out = append(out, m)
		}
	}
	return out, nil
}

// ownsSnapshot reports whether the job record inside the snapshot belongs to uid.
func (a *Agent) ownsSnapshot(m *ckpt.Manifest, uid uint32) bool {
	b, err := os.ReadFile(filepath.Join(a.store.Path(m.Job, m.ID), snapJob))
	if err != nil {
		return false
	}
	var j Job
	return json.Unmarshal(b, &j) == nil && j.UID == uid
}
