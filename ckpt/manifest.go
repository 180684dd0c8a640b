package ckpt

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/ftkit/ftkit/tcpflow"
)

// ManifestName is the file, inside every snapshot directory, that describes it.
const ManifestName = "manifest.json"

const (
	manifestFormat = "ftkit-snapshot-manifest"
	// ManifestVersion is the manifest schema this package writes and the only
	// one it reads; a schema change bumps it so old readers refuse clearly.
	ManifestVersion = 1
	// MaxManifestBytes bounds what DecodeManifest accepts, so a hostile or
	// corrupt file cannot make a reader allocate without limit.
	MaxManifestBytes = 16 << 20
	// MaxFiles bounds the number of files one snapshot may hold.
	MaxFiles = 1 << 17

	maxNameLen      = 4096
	maxComponentLen = 255
	maxDepth        = 16
)

// Mode says how a snapshot was coordinated with the job's other nodes.
type Mode string

const (
	// ModeUncoordinated: each node snapshots on its own schedule.
	ModeUncoordinated Mode = "uncoordinated"
	// ModeSemiCoordinated: processes inside one node are snapshotted together,
	// inter-node traffic is logged.
	ModeSemiCoordinated Mode = "semi-coordinated"
)

// Conn is one TCP connection as CRIU saved it (tcp-stream-<inode>.img plus the
// addresses from files.img). Sequence numbers are raw 32-bit TCP values.
type Conn struct {
	// Tuple is the connection seen from the snapshotted socket (Local is the job's end); embedded, so
	// its JSON fields stay "local" and "remote".
	tcpflow.Tuple
	Inode     uint64 `json:"inode"`
	InqSeq    uint32 `json:"inq_seq"`
	InqLen    uint32 `json:"inq_len"`
	OutqSeq   uint32 `json:"outq_seq"`
	OutqLen   uint32 `json:"outq_len"`
	Timestamp uint32 `json:"timestamp"`
	// Connecting says the socket was still connecting (SYN_SENT) at the dump: InqSeq is no sequence number
	// of the peer's stream (the kernel's 0), so no receive point or replay may be based on it.
	Connecting bool `json:"connecting,omitempty"`
	// FinUnacked says the socket had sent its FIN (queued it, at least) and the peer had not acknowledged it
	// at the dump (FIN_WAIT1, CLOSING, LAST_ACK): CRIU's OutqSeq (write_seq) then counts the FIN's sequence
	// number and its OutqLen does not, so the bytes not acknowledged start at OutqSeq-OutqLen-1, not at
	// OutqSeq-OutqLen. Absent in manifests written before 2026-12.
	FinUnacked bool `json:"fin_unacked,omitempty"`
	// SentPrefix is what the job had written before the dump in the 64 KiB receive-digest block holding
	// OutqSeq (recvdigest): the check of the bytes a restore re-sends begins mid-block with it. Nil if the
	// sender could not read them: the re-sent bytes of that block are then unverifiable.
	SentPrefix *SentPrefix `json:"sent_prefix,omitempty"`
}

// SentPrefix is the CRC-32C (Castagnoli) of the Len bytes a connection carried up to OutqSeq, from the
// start of OutqSeq's block or from the connection's first byte if that is later.
type SentPrefix struct {
	Len uint32 `json:"len"`
	CRC uint32 `json:"crc"`
}

// OpenFile is a regular file the job had open when it was dumped.
type OpenFile struct {
	Path string `json:"path"`
	Size int64  `json:"size"`
}

// FileEntry is one file of the snapshot, named relative to the snapshot
// directory with '/' separators.
type FileEntry struct {
	Name   string `json:"name"`
	Size   int64  `json:"size"`
	SHA256 string `json:"sha256"`
}

// DumpStats are CRIU's dump statistics (stats-dump), converted to durations.
type DumpStats struct {
	FreezingTime time.Duration `json:"freezing_time_ns"`
	FrozenTime   time.Duration `json:"frozen_time_ns"`
	MemdumpTime  time.Duration `json:"memdump_time_ns"`
	MemwriteTime time.Duration `json:"memwrite_time_ns"`
	PagesScanned uint64        `json:"pages_scanned"`
	PagesWritten uint64        `json:"pages_written"`
}

// Info is the part of a manifest the caller (the agent) supplies at Commit.
type Info struct {
	CRIUVersion   string `json:"criu_version"`
	KernelRelease string `json:"kernel_release"`
	Mode          Mode   `json:"mode"`
	// DumpDuration is the wall time the dump cost the job; the interval
	// policy can be seeded from it after a restart.
	DumpDuration time.Duration `json:"dump_duration_ns"`
	Stats        DumpStats     `json:"stats"`
	Conns        []Conn        `json:"conns"`
	OpenFiles    []OpenFile    `json:"open_files"`
	// Positions says Polls was read at the dump (the job frozen): each thread's readiness calls so far, by
	// its id in the job's PID namespace (intercept's receive positions); a thread that made none is absent.
	Positions bool              `json:"positions,omitempty"`
	Polls     map[uint32]uint64 `json:"polls,omitempty"`
}

// MaxThreads bounds the threads whose readiness calls a manifest records (the recorder's map holds 65536
// for all jobs of a host).
const MaxThreads = 1 << 16

// Manifest describes one committed snapshot.
type Manifest struct {
	Job     string    `json:"job"`
	Node    string    `json:"node"`
	ID      string    `json:"id"`
	Created time.Time `json:"created"`
	// Parent is the id of the snapshot of the same job and node that was the
	// newest when this one began ("" for the first).
	Parent string `json:"parent"`
	Info
	// Files lists every file of the snapshot except the manifest, sorted by name.
	Files []FileEntry `json:"files"`
	// Replicas names other nodes holding a verified copy.
	Replicas []string `json:"replicas"`
}

// Replicated reports whether a verified copy lives on at least one other node.
func (m *Manifest) Replicated() bool { return len(m.Replicas) > 0 }

// TotalSize is the sum of the sizes of the snapshot's files (Validate refuses a sum beyond int64).
func (m *Manifest) TotalSize() int64 {
	var n int64
	for _, f := range m.Files {
		n += f.Size
	}
	return n
}

// File returns the entry named name.
func (m *Manifest) File(name string) (FileEntry, bool) {
	i, ok := slices.BinarySearchFunc(m.Files, name, func(f FileEntry, n string) int { return strings.Compare(f.Name, n) })
	if !ok {
		return FileEntry{}, false
	}
	return m.Files[i], true
}

// envelope carries the manifest with a checksum over its compact JSON, so a
// flipped bit in, say, a TCP sequence number is caught before a restore uses it.
type envelope struct {
	Format   string          `json:"format"`
	Version  int             `json:"version"`
	SHA256   string          `json:"sha256"`
	Manifest json.RawMessage `json:"manifest"`
}

// Encode returns the manifest file's bytes. It validates first, so only
// manifests that DecodeManifest accepts are ever written.
func (m *Manifest) Encode() ([]byte, error) {
	if err := m.Validate(); err != nil {
		return nil, err
	}
	body, err := json.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("encode manifest of %s/%s: %w", m.Job, m.ID, err)
	}
	sum := sha256.Sum256(body)
	out, err := json.MarshalIndent(envelope{
		Format:   manifestFormat,
		Version:  ManifestVersion,
		SHA256:   hex.EncodeToString(sum[:]),
		Manifest: body,
	}, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("encode manifest of %s/%s: %w", m.Job, m.ID, err)
	}
	out = append(out, '\n')
	if len(out) > MaxManifestBytes {
		return nil, fmt.Errorf("manifest of %s/%s is %d bytes, more than the %d limit: too many files or connections", m.Job, m.ID, len(out), MaxManifestBytes)
	}
	return out, nil
}

// ErrManifestInvalid marks a manifest that is unreadable, fails its checksum
// or breaks the schema.
var ErrManifestInvalid = errors.New("invalid snapshot manifest")

// DecodeManifest parses and checks a manifest file: size limit, format,
// version, checksum, unknown fields, and Validate.
func DecodeManifest(b []byte) (*Manifest, error) {
	if len(b) > MaxManifestBytes {
		return nil, fmt.Errorf("%w: %d bytes exceeds the %d limit", ErrManifestInvalid, len(b), MaxManifestBytes)
	}
	var env envelope
	if err := strictUnmarshal(b, &env); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrManifestInvalid, err)
	}
	if env.Format != manifestFormat {
		return nil, fmt.Errorf("%w: format %q, want %q", ErrManifestInvalid, env.Format, manifestFormat)
	}
	if env.Version != ManifestVersion {
		return nil, fmt.Errorf("%w: version %d, this build reads only version %d (upgrade ftkit on this node)", ErrManifestInvalid, env.Version, ManifestVersion)
	}
	var compact bytes.Buffer
	if err := json.Compact(&compact, env.Manifest); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrManifestInvalid, err)
	}
	sum := sha256.Sum256(compact.Bytes())
	if hex.EncodeToString(sum[:]) != env.SHA256 {
		return nil, fmt.Errorf("%w: checksum mismatch (the manifest file is corrupt)", ErrManifestInvalid)
	}
	var m Manifest
	if err := strictUnmarshal(compact.Bytes(), &m); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrManifestInvalid, err)
	}
	if err := m.Validate(); err != nil {
		return nil, err
	}
	m.Created = m.Created.UTC()
	return &m, nil
}

func strictUnmarshal(b []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if dec.More() {
		return errors.New("trailing data after JSON value")
	}
	return nil
}

// Validate checks the manifest's invariants; every error wraps ErrManifestInvalid.
func (m *Manifest) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrManifestInvalid, fmt.Sprintf(format, args...))
	}
	if err := ValidName(m.Job); err != nil {
		return bad("job: %v", err)
	}
	if err := ValidName(m.Node); err != nil {
		return bad("node: %v", err)
	}
	id, err := ParseID(m.ID)
	if err != nil {
		return bad("%v", err)
	}
	if id.Node != m.Node {
		return bad("id %q names node %q but the manifest says %q", m.ID, id.Node, m.Node)
	}
	if m.Parent != "" {
		if _, err := ParseID(m.Parent); err != nil {
			return bad("parent: %v", err)
		}
		if m.Parent >= m.ID {
			return bad("parent %q is not older than %q", m.Parent, m.ID)
		}
	}
	if m.Created.IsZero() {
		return bad("created time missing")
	}
	switch m.Mode {
	case ModeUncoordinated, ModeSemiCoordinated:
	default:
		return bad("mode %q, want %q or %q", m.Mode, ModeUncoordinated, ModeSemiCoordinated)
	}
	if m.DumpDuration < 0 {
		return bad("negative dump duration")
	}
	for i, c := range m.Conns {
		if !c.Local.IsValid() || !c.Remote.IsValid() {
			return bad("connection %d: local and remote address must both be set", i)
		}
	}
	for i, f := range m.OpenFiles {
		if f.Path == "" || f.Size < 0 || strings.IndexByte(f.Path, 0) >= 0 {
			return bad("open file %d: empty path, NUL byte or negative size", i)
		}
	}
	if len(m.Polls) > MaxThreads || (!m.Positions && len(m.Polls) > 0) {
		return bad("readiness calls of %d threads (at most %d, and only with positions)", len(m.Polls), MaxThreads)
	}
	for tid := range m.Polls {
		if tid == 0 {
			return bad("readiness calls of thread 0")
		}
	}
	if len(m.Files) > MaxFiles {
		return bad("%d files, more than the %d limit", len(m.Files), MaxFiles)
	}
	var total int64
	for i, f := range m.Files {
		if err := ValidFileName(f.Name); err != nil {
			return bad("file %d: %v", i, err)
		}
		if f.Size < 0 {
			return bad("file %q: negative size", f.Name)
		}
		// A sum that wraps would pass any bound on TotalSize (a receiver's MaxSnapshotBytes).
		if f.Size > math.MaxInt64-total {
			return bad("file %q: the files' sizes add up to more than %d bytes", f.Name, int64(math.MaxInt64))
		}
		total += f.Size
		if len(f.SHA256) != 2*sha256.Size || strings.ToLower(f.SHA256) != f.SHA256 {
			return bad("file %q: sha256 must be 64 lower-case hex digits", f.Name)
		}
		if _, err := hex.DecodeString(f.SHA256); err != nil {
			return bad("file %q: sha256: %v", f.Name, err)
		}
		if i > 0 && m.Files[i-1].Name >= f.Name {
			return bad("files not sorted or duplicated at %q", f.Name)
		}
		// A file may not also be a directory of another ("a" and "a/b").
		if i > 0 && strings.HasPrefix(f.Name, m.Files[i-1].Name+"/") {
			return bad("file %q is also a directory", m.Files[i-1].Name)
		}
	}
	// Sorting puts "a/b" after "a-x", so the prefix check above needs a set too.
	if len(m.Files) > 1 {
		names := make(map[string]struct{}, len(m.Files))
		for _, f := range m.Files {
			names[f.Name] = struct{}{}
		}
		for _, f := range m.Files {
			for d := f.Name; ; {
				j := strings.LastIndexByte(d, '/')
				if j < 0 {
					break
				}
				d = d[:j]
				if _, ok := names[d]; ok {
					return bad("file %q is also a directory", d)
				}
			}
		}
	}
	for i, r := range m.Replicas {
		if err := ValidName(r); err != nil {
			return bad("replica %d: %v", i, err)
		}
		if i > 0 && m.Replicas[i-1] >= r {
			return bad("replicas not sorted or duplicated at %q", r)
		}
	}
	return nil
}

// MaxNameLen bounds a job or node name (ValidName).
const MaxNameLen = 128

// ValidName checks a job or node name: 1..MaxNameLen bytes of [A-Za-z0-9._-], not
// starting with '.' (hidden names are the store's own temporaries).
func ValidName(s string) error {
	if s == "" || len(s) > MaxNameLen {
		return fmt.Errorf("name %q must be 1..%d bytes", s, MaxNameLen)
	}
	if s[0] == '.' {
		return fmt.Errorf("name %q must not start with '.'", s)
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			return fmt.Errorf("name %q: byte %q not allowed (use A-Z a-z 0-9 . _ -)", s, c)
		}
	}
	return nil
}

// ValidFileName checks a snapshot file name: relative, '/'-separated, each
// component a safe printable name that does not start with '.', so it can
// never leave the snapshot directory or collide with the store's temporaries.
func ValidFileName(name string) error {
	if name == "" || len(name) > maxNameLen {
		return fmt.Errorf("file name %q must be 1..%d bytes", name, maxNameLen)
	}
	parts := strings.Split(name, "/")
	if len(parts) > maxDepth {
		return fmt.Errorf("file name %q is nested deeper than %d", name, maxDepth)
	}
	for _, p := range parts {
		if p == "" || len(p) > maxComponentLen {
			return fmt.Errorf("file name %q has an empty or over-long component", name)
		}
		if p[0] == '.' {
			return fmt.Errorf("file name %q has a component starting with '.'", name)
		}
		for i := 0; i < len(p); i++ {
			c := p[i]
			if c < 0x21 || c > 0x7e || c == '\\' {
				return fmt.Errorf("file name %q: byte %q not allowed", name, c)
			}
		}
	}
	if name == ManifestName {
		return fmt.Errorf("file name %q is reserved for the manifest", name)
	}
	return nil
}
