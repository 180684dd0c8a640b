package ship

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// deadlineLog is a connection that remembers the furthest deadline set on it, from when it was set.
type deadlineLog struct {
	net.Conn
	mu       sync.Mutex
	furthest time.Duration
}

func (d *deadlineLog) SetDeadline(t time.Time) error {
	d.mu.Lock()
	d.furthest = max(d.furthest, time.Until(t))
	d.mu.Unlock()
	return d.Conn.SetDeadline(t)
}

// A receiver that offered bases waits for BASE as long as its sender may take to read and hash the one it
// picks (before, only its idle timeout: a sender without a kept index of a base of about 60 GB on a cold
// disk never got a diff through, and tried again with each snapshot).
func TestReceiverWaitsForBaseIndexing(t *testing.T) {
	origin, prot := openStore(t, "node1"), openStore(t, "prot")
	pages := memoryPages(2<<20, 1)
	shipPipe(t, origin, prot, makeSnapshot(t, origin, "job", deltaFiles(pages, memoryPages(1<<20, 2))).ID, SendOptions{})
	m2 := makeSnapshot(t, origin, "job", deltaFiles(rewritePages(pages, 10, 3), memoryPages(1<<20, 2)))

	const idle = time.Minute
	c1, c2 := net.Pipe()
	defer c1.Close()
	rconn := &deadlineLog{Conn: c2}
	got := make(chan error, 1)
	var r *Received
	go func() {
		defer c2.Close()
		var err error
		r, err = Receive(context.Background(), rconn, prot, ReceiveOptions{Peer: "node1", Authorize: FromNode("node1"), IdleTimeout: idle})
		got <- err
	}()
	_, err := Send(context.Background(), c1, origin, "job", m2.ID, SendOptions{Peer: "prot"})
	if rerr := <-got; err != nil || rerr != nil {
		t.Fatalf("send: %v; receive: %v", err, rerr)
	}
	if r.BaseID == "" {
		t.Fatal("sent whole; the test needs a diff")
	}
	if rconn.furthest <= idle {
		t.Errorf("the receiver waited at most %v for a frame, its idle timeout; want %v more (the time to hash the base) while the sender picks its base", rconn.furthest, hashAllowance(m2.TotalSize()))
	}
}

// A receiver waits for BASE as long as its sender may take to read and hash the largest base it offers,
// not the snapshot being sent: a job whose memory shrank has a base much larger than its new snapshot
// (before, the wait and the whole transfer's bound took the new snapshot's size, and a sender without a
// kept index of a base some GB larger than its snapshot never got a diff through).
func TestReceiverWaitsForLargerBase(t *testing.T) {
	origin, prot := openStore(t, "node1"), openStore(t, "prot")
	p, err := origin.Begin("job")
	if err != nil {
		t.Fatal(err)
	}
	// 120 MiB of a sparse pages file: 3 s to hash at hashAllowance's rate, against 1 s for the new snapshot.
	if err := os.WriteFile(filepath.Join(p.Dir(), "pagemap-1.img"), []byte("pagemap"), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.Create(filepath.Join(p.Dir(), "pages-1.img"))
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(120 << 20); err != nil {
		t.Fatal(err)
	}
	f.Close()
	base, err := p.Commit(context.Background(), testInfo())
	if err != nil {
		t.Fatal(err)
	}
	shipPipe(t, origin, prot, base.ID, SendOptions{})
	m2 := makeSnapshot(t, origin, "job", map[string][]byte{"pagemap-1.img": []byte("pagemap"), "pages-1.img": memoryPages(2<<20, 1)})

	const idle = time.Minute
	c1, c2 := net.Pipe()
	defer c1.Close()
	rconn := &deadlineLog{Conn: c2}
	got := make(chan error, 1)
	var r *Received
	go func() {
		defer c2.Close()
		var err error
		// A bound of the whole transfer by the new snapshot's size alone would end the wait first.
		r, err = Receive(context.Background(), rconn, prot, ReceiveOptions{Peer: "node1", Authorize: FromNode("node1"), IdleTimeout: idle, PerMiB: time.Millisecond})
		got <- err
	}()
	_, err = Send(context.Background(), c1, origin, "job", m2.ID, SendOptions{Peer: "prot"})
	if rerr := <-got; err != nil || rerr != nil {
		t.Fatalf("send: %v; receive: %v", err, rerr)
	}
	if r.BaseID != base.ID {
		t.Fatalf("diffed against %q; the test needs a diff against %s", r.BaseID, base.ID)
	}
	if want := idle + hashAllowance(base.TotalSize()) - time.Second; rconn.furthest < want {
		t.Errorf("the receiver waited at most %v for a frame; want at least %v (its idle timeout and the time to hash the %d-byte base it offered)", rconn.furthest, want, base.TotalSize())
	}
}
