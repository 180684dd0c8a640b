package image

import (
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"

	sk_inet "github.com/checkpoint-restore/go-criu/v7/crit/images/sk-inet"
	"google.golang.org/protobuf/proto"
)

// An Edit is one change to the images of a TCP connection. Apply runs several
// Edits on one connection with a single decode and a single rewrite of each
// image touched.
type Edit struct {
	name  string
	apply func(*conn) error
}

// conn is what edits work on: the socket's files.img entry and its stream.
type conn struct {
	inode       uint32
	sk          *sk_inet.InetSkEntry
	stream      *tcpStream
	streamName  string
	skDirty     bool
	streamDirty bool
}

// InjectReceive appends data to the receive queue, as if the peer's bytes had
// arrived before the dump: inq_len and inq_seq grow by len(data) (mod 2^32)
// and rcv_wup moves to the new inq_seq. Refused unless the socket can still
// receive (ESTABLISHED, FIN_WAIT1, FIN_WAIT2). data is not copied until Apply.
func InjectReceive(data []byte) Edit {
	return Edit{name: "inject receive bytes", apply: func(c *conn) error {
		switch st := c.sk.GetState(); st {
		case tcpEstablish, tcpFinWait1, tcpFinWait2:
		default:
			return fmt.Errorf("image %s: socket inode %d is in TCP state %d, which has received the peer's FIN; bytes cannot follow it: %w",
				filesName, c.inode, st, ErrInconsistent)
		}
		c.streamDirty = true
		return c.stream.appendReceive(c.streamName, data)
	}}
}

// ClearReceive empties the receive queue, as if its bytes had not yet
// arrived: inq_seq (rcv_nxt) moves back by inq_len (mod 2^32) to the first
// unread byte, inq_len becomes 0. The caller delivers the bytes later itself
// (restore.InjectFromPeer), read them first with ReceiveQueue. If the window
// was last advertised (rcv_wup) inside the queue, rcv_wup moves back to the
// new rcv_nxt and rcv_wnd grows by as much, so that the right edge of the
// window the peer was told, rcv_wup+rcv_wnd, stays where it was: the kernel
// never shrinks an advertised window, and bytes the peer may still send must
// stay acceptable. Refused unless the socket can still receive (ESTABLISHED,
// FIN_WAIT1, FIN_WAIT2): after the peer's FIN, the FIN's sequence number
// follows the queue and the bytes cannot be delivered before it any more.
func ClearReceive() Edit {
	return Edit{name: "clear receive queue", apply: func(c *conn) error {
		switch st := c.sk.GetState(); st {
		case tcpEstablish, tcpFinWait1, tcpFinWait2:
		default:
			return fmt.Errorf("image %s: socket inode %d is in TCP state %d, which has received the peer's FIN; its receive queue cannot be re-delivered before it: %w",
				filesName, c.inode, st, ErrInconsistent)
		}
		c.streamDirty = true
		return c.stream.clearReceive(c.streamName)
	}}
}

// Timestamp sets the TCP timestamp clock the restored socket resumes from
// (TCP_TIMESTAMP, in milliseconds). An odd ts is rounded up to even: since
// Linux 6.7 the low bit selects microsecond timestamps, and rounding up never
// puts the clock behind what the peer has seen (PAWS). Refused if the
// connection has no timestamps or uses microsecond ones.
func Timestamp(ts uint32) Edit {
	return Edit{name: "set timestamp", apply: func(c *conn) error {
		e := c.stream.entry
		if e.GetOptMask()&tcpiOptTimestamps == 0 {
			return fmt.Errorf("image %s: field timestamp: the connection did not negotiate TCP timestamps (opt_mask %#x): %w",
				c.streamName, e.GetOptMask(), ErrInconsistent)
		}
		if e.GetTimestamp()&1 != 0 {
			return fmt.Errorf("image %s: field timestamp %#x has the low bit set: the connection uses microsecond timestamps, a millisecond value would break it: %w",
				c.streamName, e.GetTimestamp(), ErrInconsistent)
		}
		ts += ts & 1 // wraps to 0 from 2^32-1, like the TS clock itself
		e.Timestamp = proto.Uint32(ts)
		c.streamDirty = true
		return nil
	}}
}

// Windows sets the send window and the largest window the peer ever offered
// (bytes, already scaled). Raise them so that bytes re-sent after a restore
// fit in what the socket believes the peer accepts. Refused if the image has
// no window data (CRIU then restores none) or maxWindow < sndWnd (the kernel
// rejects that).
func Windows(sndWnd, maxWindow uint32) Edit {
	return Edit{name: "set windows", apply: func(c *conn) error {
		e := c.stream.entry
		if e.SndWnd == nil {
			return fmt.Errorf("image %s: fields snd_wnd/max_window are absent (the dumping kernel gave no TCP_REPAIR_WINDOW), CRIU would ignore new values: %w",
				c.streamName, ErrInconsistent)
		}
		e.SndWnd = proto.Uint32(sndWnd)
		e.MaxWindow = proto.Uint32(maxWindow)
		c.streamDirty = true
		return nil // max_window >= snd_wnd is checked with the final state
	}}
}

// SendBuffer sets the socket's so_sndbuf in files.img, in the units getsockopt
// reports (CRIU restores it by passing half to SO_SNDBUFFORCE, which doubles).
func SendBuffer(bytes uint32) Edit {
	return Edit{name: "set send buffer", apply: func(c *conn) error {
		if bytes < 2 || bytes > math.MaxInt32 {
			return fmt.Errorf("image %s: socket inode %d: field so_sndbuf %d is outside 2..%d: %w",
				filesName, c.inode, bytes, math.MaxInt32, ErrInconsistent)
		}
		opts := c.sk.GetOpts()
		if opts == nil {
			return fmt.Errorf("image %s: socket inode %d has no field opts: %w", filesName, c.inode, ErrFormat)
		}
		opts.SoSndbuf = proto.Uint32(bytes)
		c.skDirty = true
		return nil
	}}
}

// Apply runs edits, in order, on the TCP connection with this socket inode in
// the dump at dir. It decodes files.img and the connection's tcp-stream image
// once, checks the result is still consistent, and rewrites only the images
// that changed, each atomically (temp file, fsync, rename). If any edit is
// refused nothing is written. The two images are replaced one after the other,
// so a crash in between can leave only one of them edited; callers that need
// all-or-nothing across both should work on a copy of the dump.
func Apply(dir string, inode uint32, edits ...Edit) error {
	files, err := readFiles(dir)
	if err != nil {
		return err
	}
	idx, err := files.tcpSocket(inode)
	if err != nil {
		return err
	}
	c := &conn{inode: inode, sk: files.entries[idx].GetIsk(), streamName: tcpStreamName(inode)}
	b, err := os.ReadFile(tcpStreamPath(dir, inode))
	if err != nil {
		return fmt.Errorf("read CRIU image of socket inode %d: %w", inode, err)
	}
	if c.stream, err = decodeTCPStream(c.streamName, b); err != nil {
		return err
	}
	for i, ed := range edits {
		if ed.apply == nil {
			return errors.New("image: zero Edit passed to Apply; build edits with InjectReceive, ClearReceive, Timestamp, Windows or SendBuffer")
		}
		if err := ed.apply(c); err != nil {
			return fmt.Errorf("edit %d (%s): %w", i, ed.name, err)
		}
	}
	if err := c.stream.validate(c.streamName); err != nil {
		return err
	}
	// Encode everything before writing anything, so an encoding error
	// leaves both images untouched.
	var streamOut, filesOut []byte
	if c.streamDirty {
		if streamOut, err = c.stream.encode(); err != nil {
			return fmt.Errorf("image %s: %w", c.streamName, err)
		}
	}
	if c.skDirty {
		if err := files.replace(idx); err != nil {
			return err
		}
		filesOut = files.encode()
	}
	if streamOut != nil {
		if err := writeFileAtomic(tcpStreamPath(dir, inode), streamOut); err != nil {
			return err
		}
	}
	if filesOut != nil {
		if err := writeFileAtomic(filepath.Join(dir, filesName), filesOut); err != nil {
			return err
		}
	}
	return nil
}

// InjectReceiveBytes is Apply(dir, inode, InjectReceive(data)).
func InjectReceiveBytes(dir string, inode uint32, data []byte) error {
	return Apply(dir, inode, InjectReceive(data))
}

// ClearReceiveQueue is Apply(dir, inode, ClearReceive()).
func ClearReceiveQueue(dir string, inode uint32) error {
	return Apply(dir, inode, ClearReceive())
}

// SetTimestamp is Apply(dir, inode, Timestamp(ts)).
func SetTimestamp(dir string, inode, ts uint32) error {
	return Apply(dir, inode, Timestamp(ts))
}

// SetWindows is Apply(dir, inode, Windows(sndWnd, maxWindow)).
func SetWindows(dir string, inode, sndWnd, maxWindow uint32) error {
	return Apply(dir, inode, Windows(sndWnd, maxWindow))
}

// SetSendBuffer is Apply(dir, inode, SendBuffer(bytes)).
func SetSendBuffer(dir string, inode, bytes uint32) error {
	return Apply(dir, inode, SendBuffer(bytes))
}
