package ship

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/ckpt"
)

// The longest ids a valid node name makes fit the frames that carry them: ACCEPT's and BASE's limits were
// for ids of 128 bytes, and a node name over 100 bytes made every diff's BASE frame too long (the
// protector refused each transfer of that node for good).
func TestFramesHoldLongestIDs(t *testing.T) {
	node := strings.Repeat("n", ckpt.MaxNameLen)
	var ids []string
	for i := range maxOffers {
		ids = append(ids, ckpt.SnapshotID{Time: time.Date(2026, 12, 6, 0, 0, 0, 0, time.UTC), Node: node, Seq: uint64(999990 + i)}.String())
	}
	if len(ids[0]) != ckpt.MaxIDLen {
		t.Fatalf("id of a %d-byte node name is %d bytes, MaxIDLen %d", len(node), len(ids[0]), ckpt.MaxIDLen)
	}
	if p := offersPayload(ids); len(p) > maxPayload(frameAccept) {
		t.Errorf("ACCEPT offering %d such ids is %d bytes, over its limit %d", len(ids), len(p), maxPayload(frameAccept))
	} else if got, err := parseOffers(p); err != nil || len(got) != len(ids) {
		t.Errorf("parseOffers = %v, %v", got, err)
	}
	b := basePayload(&baseIndex{id: ids[0], bs: minDeltaBlock})
	if len(b) > maxPayload(frameBase) {
		t.Errorf("BASE naming such an id is %d bytes, over its limit %d", len(b), maxPayload(frameBase))
	} else if ref, ok, err := parseBase(b); err != nil || !ok || ref.id != ids[0] {
		t.Errorf("parseBase = %+v, %v, %v", ref, ok, err)
	}
	if len(node) > maxPayload(frameOK) || len(node) > maxPayload(frameHave) {
		t.Errorf("OK and HAVE carry a node name of up to %d bytes; limits %d and %d", len(node), maxPayload(frameOK), maxPayload(frameHave))
	}
}

// A node with the longest name sends its second snapshot as a diff against its first.
func TestDiffFromLongestNodeName(t *testing.T) {
	node := strings.Repeat("n", ckpt.MaxNameLen)
	origin, prot := openStore(t, node), openStore(t, "prot")
	ship := func(id string) *Received {
		t.Helper()
		c1, c2 := net.Pipe()
		defer c1.Close()
		got := make(chan error, 1)
		var r *Received
		go func() {
			defer c2.Close()
			var err error
			r, err = Receive(context.Background(), c2, prot, ReceiveOptions{Peer: node, Authorize: FromNode(node)})
			got <- err
		}()
		_, err := Send(context.Background(), c1, origin, "job", id, SendOptions{Peer: "prot"})
		if rerr := <-got; err != nil || rerr != nil {
			t.Fatalf("transfer of %s: send: %v; receive: %v", id, err, rerr)
		}
		return r
	}
	pages := memoryPages(2<<20, 1)
	ship(makeSnapshot(t, origin, "job", deltaFiles(pages, memoryPages(1<<20, 2))).ID)
	m2 := makeSnapshot(t, origin, "job", deltaFiles(rewritePages(pages, 10, 3), memoryPages(1<<20, 2)))
	if r := ship(m2.ID); r.BaseID == "" {
		t.Errorf("the second snapshot went whole (received %+v); want a diff against the first", r)
	}
}
