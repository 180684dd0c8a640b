//go:build linux

package restore

import (
	"errors"
	"fmt"
	"regexp"

	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/criu/image"
)

// Rewrite applies p to the CRIU images in dir: for each connection, one
// image.Apply with the injected bytes, the timestamp, and the windows and
// send buffer raised where the plan needs more than the image has. Each
// connection is first checked against the images (same socket, same
// sequence numbers), so a plan made from another snapshot's manifest is
// refused before anything is written. Connections are rewritten one after
// the other: on error some may be edited already, so work on a copy of the
// snapshot and discard it on failure.
func Rewrite(dir string, p Plan) error {
	conns, err := image.TCPConnections(dir)
	if err != nil {
		return fmt.Errorf("rewrite images in %s: %w", dir, err)
	}
	byInode := make(map[uint64]image.TCPConn, len(conns))
	for _, c := range conns {
		byInode[uint64(c.Inode)] = c
	}
	for _, cp := range p.Conns {
		img, ok := byInode[cp.Conn.Inode]
		if !ok {
			return fmt.Errorf("rewrite images in %s: connection %v: no TCP socket with inode %d in the images: the plan is for another snapshot", dir, cp.Conn.Tuple, cp.Conn.Inode)
		}
		if err := sameConn(cp.Conn, img); err != nil {
			return fmt.Errorf("rewrite images in %s: %w", dir, err)
		}
		edits, err := connEdits(cp, img)
		if err != nil {
			return fmt.Errorf("rewrite images in %s: %w", dir, err)
		}
		if len(edits) == 0 {
			continue
		}
		if err := image.Apply(dir, img.Inode, edits...); err != nil {
			return fmt.Errorf("rewrite images in %s: connection %v: %w", dir, cp.Conn.Tuple, err)
		}
	}
	return nil
}

// sameConn checks that the manifest's connection is the image's socket.
func sameConn(c ckpt.Conn, img image.TCPConn) error {
	if c.Local != img.Local || c.Remote != img.Remote || c.InqSeq != img.InqSeq || c.InqLen != img.InqLen ||
		c.OutqSeq != img.OutqSeq || c.OutqLen != img.OutqLen || c.Timestamp != img.Timestamp {
		return fmt.Errorf("connection %v (inode %d) in the plan has inq %d+%d, outq %d+%d, ts %d; the image's socket is %v->%v with inq %d+%d, outq %d+%d, ts %d: the plan is for another snapshot",
			c.Tuple, c.Inode, c.InqSeq, c.InqLen, c.OutqSeq, c.OutqLen, c.Timestamp,
			img.Local, img.Remote, img.InqSeq, img.InqLen, img.OutqSeq, img.OutqLen, img.Timestamp)
	}
	return nil
}

// connEdits turns a connection's plan into image edits, raising (never
// lowering) the image's windows and send buffer.
func connEdits(cp ConnPlan, img image.TCPConn) ([]image.Edit, error) {
	var edits []image.Edit
	switch {
	case cp.Deferred:
		if img.InqLen > 0 {
			edits = append(edits, image.ClearReceive())
		}
		if len(cp.Preload) > 0 {
			edits = append(edits, image.InjectReceive(cp.Preload))
		}
	case len(cp.Inject) > 0:
		edits = append(edits, image.InjectReceive(cp.Inject))
	}
	if img.HasTimestamp && !cp.HasTimestamp {
		// Left as it is, the restored clock is the snapshot's, behind the TSvals the peer took from the
		// original since: its PAWS check would drop every segment of the restored socket.
		return nil, fmt.Errorf("connection %v: the snapshot's socket negotiated TCP timestamps but the peer's state has none, so the restored clock cannot be set past what the peer saw: wrong peer state: %w", cp.Conn.Tuple, ErrNotRecoverable)
	}
	if cp.HasTimestamp {
		if !img.HasTimestamp {
			return nil, fmt.Errorf("connection %v: the peer uses TCP timestamps but the snapshot's socket did not negotiate them: wrong peer state: %w", cp.Conn.Tuple, ErrNotRecoverable)
		}
		edits = append(edits, image.Timestamp(cp.Timestamp))
	}
	sndWnd := max(img.SndWnd, cp.SndWnd)
	maxWnd := max(img.MaxWindow, cp.MaxWindow, sndWnd)
	if sndWnd != img.SndWnd || maxWnd != img.MaxWindow {
		if !img.HasWindow {
			return nil, fmt.Errorf("connection %v: %d bytes must be re-sent at once but the image has no window data to raise (the dumping kernel gave none): %w",
				cp.Conn.Tuple, cp.Resend, ErrNotRecoverable)
		}
		edits = append(edits, image.Windows(sndWnd, maxWnd))
	}
	if cp.SndBuf > img.SoSndbuf {
		edits = append(edits, image.SendBuffer(cp.SndBuf))
	}
	return edits, nil
}

// runIDRE is what CRIU's run ids look like (uuid_unparse); anything else is
// refused before it reaches an nft command line.
var runIDRE = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)

// RunID returns the run id of the CRIU dump in dir (inventory.img), which
// names the nftables table its restore deletes (Guard). It refuses a dump
// that did not use the nftables lock, or from a CRIU too old to record its
// run id: their restore would not delete the guard.
func RunID(dir string) (string, error) {
	inv, err := image.ReadInventory(dir)
	if err != nil {
		return "", fmt.Errorf("read the dump's run id: %w", err)
	}
	if inv.NetworkLock != image.NetworkLockNFTables {
		return "", fmt.Errorf("dump in %s used the %v network lock; the restore guard needs nftables (criu dump --network-lock nftables)", dir, inv.NetworkLock)
	}
	if inv.RunID == "" {
		return "", errors.New("dump in " + dir + " records no run id (CRIU older than 3.19): its restore names the lock table after a PID, which the guard cannot know; dump with CRIU 4.2+")
	}
	if !runIDRE.MatchString(inv.RunID) {
		return "", fmt.Errorf("dump in %s has run id %q, not a UUID: %w", dir, inv.RunID, image.ErrFormat)
	}
	return inv.RunID, nil
}
