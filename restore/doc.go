//go:build linux

// Package restore moves a crashed node's job to a spare host. Its subpackage
// recovery orchestrates the target's part of a fail-over as one sequence of
// steps (recovery.Run: fetch, plan and rewrite, network, restore, announce,
// replay wait, verification of the re-sent bytes, re-protection); this
// package holds the mechanics it uses: it plans and applies the edits that
// make an older CRIU snapshot's TCP sockets agree with their live peers, and
// sets up the spare's network around CRIU's restore.
//
// The recipe and the measurements behind it are in docs/tcp-relocation.md.
// On the spare, in the namespace the job will run in, recovery.Run (with the
// agent's actions behind its interfaces) does:
//
//  1. NewPlan from the snapshot's connections and what each peer's agent
//     reported (its live TCP state and its logged bytes), then Rewrite the
//     images (work on a copy of the snapshot: the edits are not atomic
//     across connections);
//  2. RunID, then Guard: drop rules for the connections, in the nftables
//     table CRIU's restore deletes when the restored sockets are ready, so
//     that no peer's retransmission reaches the spare's kernel (which would
//     answer RST) once the failed node's address is here;
//  3. TakeOver the failed node's address, SetInitCwnd to Plan.InitCwnd and
//     LowerPathMTU (all before CRIU creates the sockets: the route is read
//     at connect);
//  4. CRIU restore (criu.Client.Restore, from a process in this namespace),
//     then put the routes' MTU back, so the restored sockets resync their
//     segment size to the snapshot's MSS instead of sending 524 bytes;
//  5. Announce the address, so that peers' neighbour entries move here;
//  6. once the restored jobs have replayed (their re-sent bytes are out),
//     put the routes' initial windows back, so that the host's later
//     connections do not start with the re-sent burst's window.
//
// If the restore fails: Unguard and Release (and put the MTU back).
//
// For receive-order determinants the peers' bytes are delivered after the
// restore instead of through the images: image.ClearReceive takes the
// snapshot's receive queue out, and InjectFromPeer sends bytes to a restored
// socket as segments from its peer, as the restored process makes its
// receive calls (docs/tcp-relocation.md, "Injecting the peer's bytes").
//
// The network functions act on the calling OS thread's network namespace:
// call them with the goroutine locked in the target namespace (lab.Do, or a
// process that runs in it).
package restore
