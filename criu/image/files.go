package image

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/checkpoint-restore/go-criu/v7/crit/images/fdinfo"
	"google.golang.org/protobuf/proto"
)

const filesName = "files.img"

// Linux socket constants as CRIU stores them in InetSkEntry.
const (
	afInet        = 2
	afInet6       = 10
	ipprotoTCP    = 6
	tcpEstablish  = 1
	tcpSynSent    = 2
	tcpFinWait1   = 4
	tcpFinWait2   = 5
	tcpLastAck    = 9
	tcpClosing    = 11
	sockStreamTyp = 1
)

// filesImage is a decoded files.img. raw keeps every entry as CRIU wrote it;
// only entries replaced by an edit are re-marshalled on encode.
type filesImage struct {
	raw     [][]byte
	entries []*fdinfo.FileEntry
}

func readFiles(dir string) (*filesImage, error) {
	b, err := os.ReadFile(filepath.Join(dir, filesName))
	if err != nil {
		return nil, fmt.Errorf("read CRIU image: %w", err)
	}
	return decodeFiles(filesName, b)
}

func decodeFiles(name string, b []byte) (*filesImage, error) {
	// AllowPartial: an entry whose type is newer than go-criu's fd_types enum
	// (e.g. PIDFD) parses with its type as an unknown field, so the required
	// field looks unset. Such entries are kept raw and never interpreted.
	raw, entries, err := decodeEntries(name, b, magicFiles, "FileEntry", func() *fdinfo.FileEntry { return &fdinfo.FileEntry{} },
		proto.UnmarshalOptions{AllowPartial: true})
	if err != nil {
		return nil, err
	}
	return &filesImage{raw: raw, entries: entries}, nil
}

func (f *filesImage) encode() []byte { return encodeEntries(magicFiles, f.raw) }

// replace re-marshals entry i after an edit changed it.
func (f *filesImage) replace(i int) error {
	b, err := proto.Marshal(f.entries[i])
	if err != nil {
		return fmt.Errorf("image %s: marshal FileEntry #%d: %w", filesName, i, err)
	}
	f.raw[i] = b
	return nil
}

// tcpSockets returns the indexes of the entries that are TCP sockets.
func (f *filesImage) tcpSockets() []int {
	var idx []int
	for i, e := range f.entries {
		if e.GetType() == fdinfo.FdTypes_INETSK && e.GetIsk().GetProto() == ipprotoTCP && e.GetIsk().GetType() == sockStreamTyp {
			idx = append(idx, i)
		}
	}
	return idx
}

// tcpSocket finds the TCP socket with this inode.
func (f *filesImage) tcpSocket(inode uint32) (int, error) {
	found := -1
	for _, i := range f.tcpSockets() {
		if f.entries[i].GetIsk().GetIno() != inode {
			continue
		}
		if found >= 0 {
			return 0, fmt.Errorf("image %s: two TCP sockets with inode %d (entries #%d and #%d): %w", filesName, inode, found, i, ErrFormat)
		}
		found = i
	}
	if found < 0 {
		return 0, fmt.Errorf("image %s: no TCP socket with inode %d (%#x) in this dump", filesName, inode, inode)
	}
	return found, nil
}

// RegFile is a regular file the dumped processes had open or mapped. CRIU
// refuses to restore it if its size on disk differs from Size.
type RegFile struct {
	ID      uint32 // CRIU file id (fdinfo entries refer to it)
	Path    string // path as CRIU recorded it
	Size    uint64 // size at dump time; valid if HasSize
	HasSize bool
	Flags   uint32 // open(2) flags
	Pos     uint64 // file offset
	Mode    uint32 // st_mode at dump time (type and permissions); valid if HasMode
	HasMode bool
	// Deleted: its name was gone at the dump (remap-fpath.img). A restore recreates it from CRIU's ghost
	// copy, or reopens it through a link CRIU made, never at Path, which may name another file by then.
	Deleted bool
}

// RegularFiles lists the regular files recorded in dir/files.img, in image order.
func RegularFiles(dir string) ([]RegFile, error) {
	f, err := readFiles(dir)
	if err != nil {
		return nil, err
	}
	remapped, err := readRemapped(dir)
	if err != nil {
		return nil, err
	}
	var out []RegFile
	for i, e := range f.entries {
		if e.GetType() != fdinfo.FdTypes_REG {
			continue
		}
		r := e.GetReg()
		if r == nil {
			return nil, fmt.Errorf("image %s: FileEntry #%d has type REG but no field reg: %w", filesName, i, ErrFormat)
		}
		out = append(out, RegFile{
			ID: r.GetId(), Path: r.GetName(),
			Size: r.GetSize(), HasSize: r.Size != nil,
			Flags: r.GetFlags(), Pos: r.GetPos(),
			Mode: r.GetMode(), HasMode: r.Mode != nil,
			Deleted: remapped[r.GetId()],
		})
	}
	return out, nil
}

// NamedPath is a path at which a restore, as root, binds one of the dumped unix sockets (removing a stale
// socket file there first) or opens a FIFO.
type NamedPath struct {
	Path   string // absolute and clean
	Socket bool   // a bound unix socket; else a FIFO
	// Deleted: its name was gone at the dump. The restore makes it afresh there (a socket bound, a FIFO
	// from CRIU's ghost copy), with any missing directory on the way, then removes what it made.
	Deleted bool
	Flags   uint32 // a FIFO's open(2) flags
}

// NamedPaths lists the bound unix sockets (abstract ones have no path) and the FIFOs of the dump in dir. A
// name with a ".." element is refused: resolved from a directory that is a link, it leads elsewhere than
// its clean form says; "//" and "." elements, which the kernel skips, are dropped.
func NamedPaths(dir string) ([]NamedPath, error) {
	f, err := readFiles(dir)
	if err != nil {
		return nil, err
	}
	remapped, err := readRemapped(dir)
	if err != nil {
		return nil, err
	}
	return f.namedPaths(remapped)
}

// namedPaths lists the named paths; remapped holds the ids of the regular-file entries the dump found
// deleted (remappedFiles).
func (f *filesImage) namedPaths(remapped map[uint32]bool) ([]NamedPath, error) {
	regs := map[uint32]*fdinfo.FileEntry{}
	for _, e := range f.entries {
		if e.GetType() == fdinfo.FdTypes_REG && e.GetReg() != nil {
			regs[e.GetReg().GetId()] = e
		}
	}
	clean := func(i int, p string) (string, error) {
		if !filepath.IsAbs(p) || slices.Contains(strings.Split(p, "/"), "..") {
			return "", fmt.Errorf("image %s: FileEntry #%d names %q, not an absolute path without \"..\": %w", filesName, i, p, ErrFormat)
		}
		return filepath.Clean(p), nil
	}
	var out []NamedPath
	for i, e := range f.entries {
		switch {
		case e.GetType() == fdinfo.FdTypes_UNIXSK && e.GetUsk() != nil:
			u := e.GetUsk()
			name := string(u.GetName())
			if name == "" || name[0] == 0 { // unbound, or abstract
				continue
			}
			if i := strings.IndexByte(name, 0); i >= 0 { // a path ends at its NUL, which the image keeps
				name = name[:i]
			}
			if !strings.HasPrefix(name, "/") { // relative to the directory it was bound from, which CRIU enters
				if u.GetNameDir() == "" {
					return nil, fmt.Errorf("image %s: FileEntry #%d names socket %q without its directory: %w", filesName, i, name, ErrFormat)
				}
				name = u.GetNameDir() + "/" + name
			}
			p, err := clean(i, name)
			if err != nil {
				return nil, err
			}
			out = append(out, NamedPath{Path: p, Socket: true, Deleted: u.GetDeleted()})
		case e.GetType() == fdinfo.FdTypes_FIFO && e.GetFifo() != nil:
			// Without regf_id (CRIU before it wrote one), CRIU opens the regular-file entry of the FIFO's own
			// id (fifo.c, open_fifo_fd): entry 0's path would be checked in place of the one opened.
			regf := e.GetFifo().GetRegfId()
			if e.GetFifo().RegfId == nil {
				regf = e.GetFifo().GetId()
			}
			r := regs[regf]
			if r == nil {
				return nil, fmt.Errorf("image %s: FIFO #%d names regular-file entry %d, which it lacks: %w", filesName, i, regf, ErrFormat)
			}
			p, err := clean(i, r.GetReg().GetName())
			if err != nil {
				return nil, err
			}
			out = append(out, NamedPath{Path: p, Deleted: remapped[r.GetReg().GetId()], Flags: r.GetReg().GetFlags()})
		}
	}
	return out, nil
}

// readRemapped reads dir's remap-fpath.img (remappedFiles); only a dump that found deleted files has one.
func readRemapped(dir string) (map[uint32]bool, error) {
	b, err := os.ReadFile(filepath.Join(dir, remapName))
	if err != nil && !os.IsNotExist(err) {
		return nil, fmt.Errorf("read CRIU image: %w", err)
	}
	return remappedFiles(b)
}
